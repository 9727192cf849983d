"""Stopping the driver (issue 25, clean stops): the real `python -m asyncrl.train`.

SIGINT to the driver's process group (what Ctrl-C sends): the step in progress
finishes, then summary.json, a checkpoint and every log part are written and the
driver exits 130 with one line. SIGKILL: nothing more can be
written, but no process of the run outlives it (asyncrl.utils.watchdog) and every part
file it finished reads, whole steps in training order. Both list the driver's process tree before and after.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_sockets import assert_loopback_only

ROOT = Path(__file__).parents[1]
START_TIMEOUT_S = 400  # Ray + vLLM-CPU + the learner, on a loaded machine
STOP_BUDGET_S = 15  # what the issue asks of a SIGINT (a loaded machine gets 3x)
BATCH_GROUPS, N = 4, 8  # the SIGKILL run's trajectories per step: groups x actor.sampling.n
PART_EVERY = 2  # the SIGKILL run's steps per log part


def start_run(out: Path, *overrides: str, part_every: int = 1) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "asyncrl.train", f"hydra.run.dir={out}", "progress=false",
           "max_steps=300", f"log.part_every={part_every}", *overrides]  # fmt: skip
    out.mkdir(parents=True)
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=open(out / "stdout.txt", "w"),
        stderr=open(out / "stderr.txt", "w"),
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )  # fmt: skip


def wait_steps(p: subprocess.Popen, out: Path, steps: int) -> None:
    """Until the learner has logged ``steps`` steps (trajectories/batches.jsonl)."""
    log = out / "trajectories" / "batches.jsonl"
    deadline = time.time() + START_TIMEOUT_S
    while time.time() < deadline:
        assert p.poll() is None, (out / "stderr.txt").read_text()[-3000:]
        if log.is_file() and len(log.read_text().splitlines()) >= steps:
            return
        time.sleep(1)
    raise AssertionError(f"no {steps} steps in {START_TIMEOUT_S}s")


def wait_parts(p: subprocess.Popen, out: Path, parts: int) -> None:
    """Until the run has finished ``parts`` trajectory part files."""
    from asyncrl.utils.runlog import trajectory_parts

    deadline = time.time() + START_TIMEOUT_S
    while time.time() < deadline:
        assert p.poll() is None, (out / "stderr.txt").read_text()[-3000:]
        if len(trajectory_parts(out)) >= parts:
            return
        time.sleep(1)
    raise AssertionError(f"no {parts} parts in {START_TIMEOUT_S}s")


def tree(pid: int) -> dict[int, str]:
    """pid -> command name of ``pid`` and every descendant (from /proc/*/stat)."""
    parent, name = {}, {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            head, rest = stat.rsplit(")", 1)
            parent[int(d.name)] = int(rest.split()[1])
            name[int(d.name)] = head.split("(", 1)[1]
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        out[p] = name.get(p, "?")
        todo += [c for c, pp in parent.items() if pp == p]
    return out


def run_mark(procs: dict[int, str]) -> str:
    """The run's ASYNCRL_RUN mark, read from one of its processes' environment."""
    from asyncrl.utils.watchdog import MARK

    for pid in procs:
        try:
            for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                if kv.startswith(f"{MARK}=".encode()):
                    return kv.split(b"=", 1)[1].decode()
        except OSError:
            continue
    raise AssertionError(f"no process of the run carries {MARK}: {procs}")


def survivors(before: dict[int, str], mark: str, wait_s: float) -> dict[int, str]:
    """The processes of ``before`` (same name) or carrying ``mark`` still alive after
    up to ``wait_s`` seconds."""
    from asyncrl.utils.watchdog import marked

    deadline = time.time() + wait_s
    while True:
        alive = {}
        for pid, name in before.items():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            if f"({name})" in stat and ") Z " not in stat:  # a zombie is dead
                alive[pid] = name
        alive.update({p: "marked" for p in marked(mark)})
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.5)


@pytest.mark.slow
def test_sigint_stops_cleanly_with_everything_written(tmp_path, tiny_model):
    """Also the socket check of tests/test_sockets.py, on the same run (one run for both)."""
    from asyncrl.learner.layout import find_latest, verify
    from asyncrl.utils.runlog import read_trajectories

    out = tmp_path / "run"
    p = start_run(out)
    try:
        wait_steps(p, out, 2)  # trained and published: the broker's group is up
        before = tree(p.pid)
        mark = run_mark(before)
        from asyncrl.utils.watchdog import marked

        sockets = assert_loopback_only(sorted(set(before) | set(marked(mark))))
        t0 = time.time()
        os.killpg(p.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group
        rc = p.wait(timeout=120)
        took = time.time() - t0
    finally:
        if p.poll() is None:
            p.kill()
    err = (out / "stderr.txt").read_text()
    print(f"SIGINT -> exit {rc} in {took:.1f} s (load {os.getloadavg()[0]:.1f}); "
          f"{len(before)} processes before, {len(sockets)} listening, all loopback")  # fmt: skip
    assert rc == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("asyncrl: stopped by SIGINT after step "), last
    assert took < 3 * STOP_BUDGET_S, took
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGINT" and 2 <= summary["steps"] < 300
    ck = find_latest(out)
    assert verify(ck, full=True)["version"] == summary["policy_version"]
    rows = read_trajectories(out)
    assert rows.num_rows == summary["trajectories_trained"]  # every step's part written
    assert len(before) > 3  # Ray's and vLLM's processes were there
    left = survivors(before, mark, wait_s=30)
    assert not left, left


@pytest.mark.slow
def test_sigkill_of_the_driver_leaves_no_process_and_every_finished_part(tmp_path, tiny_model):
    """A real run SIGKILLed once three log parts exist: no process of the run is left
    (the watchdog), and every part it finished reads on its own, whole steps in order,
    each row with the learner's per-token record (the crash the parts are for)."""
    out = tmp_path / "run"
    p = start_run(out, f"learner.batch_groups={BATCH_GROUPS}", part_every=PART_EVERY)
    try:
        wait_parts(p, out, 3)
        before = tree(p.pid)
        mark = run_mark(before)
        p.send_signal(signal.SIGKILL)  # no close, no flush
        p.wait(timeout=30)
        t0 = time.time()
        left = survivors(before, mark, wait_s=60)
        took = time.time() - t0
    finally:
        if p.poll() is None:
            p.kill()
    print(f"SIGKILL: {len(before)} processes before ({sorted(set(before.values()))}), "
          f"{len(left)} left after {took:.1f} s")  # fmt: skip
    assert p.returncode == -signal.SIGKILL
    assert len(before) > 3
    assert not left, left
    assert_finished_parts(out)


def assert_finished_parts(out: Path) -> None:
    """Each part file reads on its own and holds PART_EVERY whole steps; together they
    are steps 0.. in the order the learner trained them (trajectories/batches.jsonl)."""
    import pyarrow.parquet as pq

    from asyncrl.utils.runlog import read_batches, read_trajectories, trajectory_parts

    parts = trajectory_parts(out)
    assert len(parts) >= 3
    steps: list[int] = []
    for f in parts:
        t = pq.read_table(f)
        got = sorted(set(t.column("step").to_pylist()))
        assert len(got) == PART_EVERY, (f.name, got)
        steps += got
        for row in t.to_pylist():
            n = row["response_tokens"]
            assert len(row["learner_logprobs"]) == len(row["is_weights"]) == n
            assert len(row["advantages"]) == n
    # whole steps in order (a step is logged as the version it trained, from 0)
    assert steps == list(range(len(parts) * PART_EVERY))
    table = read_trajectories(out)
    assert table.num_rows >= 0.9 * len(steps) * BATCH_GROUPS * N
    assert len(set(table.column("traj_id").to_pylist())) == table.num_rows
    batches = read_batches(out)  # one line per step, written as it trains
    assert set(steps) <= set(batches)
    logged = table.column("traj_id").to_pylist()
    assert logged == [i for s in steps for i in batches[s]]  # the order the learner used


def test_the_first_signal_asks_the_second_abandons():
    """GracefulStop in-process: before the loop a signal abandons at once; in the loop
    the first only asks for a stop, the second abandons."""
    from asyncrl.runtime import GracefulStop, Interrupted

    before = signal.getsignal(signal.SIGINT)
    stop = GracefulStop()
    stop.install()
    try:
        with pytest.raises(Interrupted) as e:
            os.kill(os.getpid(), signal.SIGTERM)
        assert (e.value.signame, e.value.during) == ("SIGTERM", "during start-up")
        stop.restore()
        stop = GracefulStop()
        stop.install()
        stop.deferring = True
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested() and stop.signame == "SIGINT"
        with pytest.raises(Interrupted, match="a second time"):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) is before  # the handlers given back


def test_a_broker_error_ends_the_run_with_one_line_and_exit_3(monkeypatch, capsys, tmp_path):
    """Issue 25: every engine gone surfaced as a Hydra traceback."""
    import asyncrl.train
    from asyncrl.broker.base import BrokerError

    def dead(cfg, out_dir):
        raise BrokerError("every actor is dead:\n  actor0: EngineGone (engine process exited)")

    monkeypatch.setattr(asyncrl.train, "run", dead)
    assert asyncrl.train.execute(None, tmp_path) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["asyncrl: run failed: every actor is dead: actor0: EngineGone (engine "
                   "process exited)"]  # fmt: skip


def test_ctrl_c_before_the_run_took_over_is_one_line_and_130(monkeypatch, capsys):
    """A SIGINT while Hydra composes (before run() installs its handlers) was a
    KeyboardInterrupt traceback."""
    import asyncrl.train

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(asyncrl.train, "_hydra_main", interrupted)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # main() sets it; undone after the test
    with pytest.raises(SystemExit) as e:
        asyncrl.train.main()
    assert e.value.code == 130
    assert capsys.readouterr().err.strip().splitlines() == [
        "asyncrl: stopped by SIGINT during start-up, before Ray"]  # fmt: skip
