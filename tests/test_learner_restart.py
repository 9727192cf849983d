"""A dead learner rank (issue 25, item 2): the run restarts from its newest checkpoint.

The real run in-process (``asyncrl.train.execute``: vLLM-CPU actor, queue, learner rank,
broker, in the session's Ray); a thread SIGKILLs the learner rank's process (its pid
from ``Learner.pid``) once the rank has logged some steps. With ``fault.max_restarts=1``
the run restarts every part, resumes from the newest complete checkpoint and finishes at
``max_steps`` with the accounting exact over both segments and the trajectory log's
parts of both segments readable; with ``fault.max_restarts=0`` it ends with one line,
exit 3. One fast test of the ledger's own arithmetic (no Ray).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir

CONF = Path(__file__).parents[1] / "conf"
KILL_DEADLINE_S = 400  # engine start + the steps before the kill, on a loaded machine
# Small steps (4 groups of 8), a part file per step, a checkpoint every 2 steps.
FAST = ("progress=false", "learner.batch_groups=4", "log.part_every=1",
        "learner.checkpoint_every=2")  # fmt: skip


def cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("config", overrides=[*FAST, *overrides])


class RankKiller:
    """SIGKILLs learner rank 0's process once ``after`` steps are in the trajectory log
    (``batches.jsonl``) and a part file is written, once. The pid comes from each segment's started parts: the real
    ``start_parts`` runs, this only reads ``Learner.pid`` of what it returns."""

    def __init__(self, monkeypatch, out: Path, after: int):
        import ray

        import asyncrl.train

        real = asyncrl.train.start_parts
        self.pids: list[int] = []

        def start_parts(*a, **k):
            parts = real(*a, **k)
            self.pids.append(ray.get(parts.learner.ranks[0].pid.remote()))
            return parts

        monkeypatch.setattr(asyncrl.train, "start_parts", start_parts)
        self.out, self.after = out, after
        self.killed_at: float | None = None
        self.parts_before: dict[str, str] = {}  # part file -> sha256, just before the kill
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        log = self.out / "trajectories" / "batches.jsonl"
        deadline = time.time() + KILL_DEADLINE_S
        while time.time() < deadline:
            steps = len(log.read_text().splitlines()) if log.is_file() else 0
            if self.pids and steps >= self.after and _parts(self.out):  # a part to keep
                self.parts_before = {p.name: _sha(p) for p in _parts(self.out)}
                os.kill(self.pids[0], signal.SIGKILL)
                self.killed_at = time.time()
                return
            time.sleep(0.2)


def _parts(out: Path) -> list[Path]:
    return sorted((out / "trajectories").glob("part-*.parquet"))


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _asyncrl_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("asyncrl:")]


@pytest.mark.slow
def test_a_killed_learner_rank_restarts_from_the_checkpoint(
    ray_local, tiny_model, tmp_path, monkeypatch, capsys
):
    import pyarrow.parquet as pq

    from asyncrl.train import execute
    from asyncrl.utils.runlog import read_trajectories

    out = tmp_path / "run"
    killer = RankKiller(monkeypatch, out, after=3)  # checkpoint 2 complete, 3 trained
    t0 = time.time()
    code = execute(cfg("max_steps=5", "fault.max_restarts=1"), out)
    took = time.time() - t0
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    assert killer.killed_at is not None and len(killer.pids) == 2  # killed once, restarted once
    assert killer.pids[0] != killer.pids[1]
    s = json.loads((out / "summary.json").read_text())
    r = s["restarts"][0]
    print(f"restart: killed at step {r['died_after_version']}, resumed from "
          f"{r['from_version']}, detected {r['detected_at'] - killer.killed_at:.1f} s after "
          f"the kill, first step {s['restart_seconds'][0]} s after that; run {took:.0f} s "
          f"(load {os.getloadavg()[0]:.1f}); accounting {s['trajectories_produced']} = "
          f"{s['trajectories_trained']} + {s['trajectories_dropped_stale']} + "
          f"{s['trajectories_in_flight']} (restart {s['trajectories_dropped_restart']}); "
          f"stop {r['stop_seconds']} s, start {r['start_seconds']} s, first step "
          f"{r['first_step_seconds']} s")  # fmt: skip
    assert s["policy_version"] == 5 and s["steps"] == 5 and s["stopped_by"] is None
    assert s["learner_restarts"] == 1 and len(s["restart_seconds"]) == 1
    assert s["fault"]["actor_restarts"] == 0, s["fault"]  # the actors were not at fault
    assert s["restart_seconds"][0] > 0 and 0 <= r["detected_at"] - killer.killed_at < 60
    phases = [r["stop_seconds"], r["start_seconds"], r["first_step_seconds"]]
    assert all(p >= 0 for p in phases) and abs(sum(phases) - r["seconds"]) < 0.05, r
    # resumed from the newest complete checkpoint at the kill: an even step (every 2)
    assert r["from_version"] in (2, 4) and r["from_version"] <= r["died_after_version"]
    assert r["checkpoint"].endswith(f"step-{r['from_version']}")
    assert s["steps_redone"] == r["died_after_version"] - r["from_version"]
    # exact over both segments; the dead one's production after the checkpoint dropped
    assert s["trajectories_produced"] == (
        s["trajectories_trained"] + s["trajectories_dropped_stale"] + s["trajectories_in_flight"]
    )
    assert 0 < s["trajectories_dropped_restart"] <= s["trajectories_dropped_stale"]
    # the parts written before the kill: unchanged and readable; the restarted
    # segment's parts came after them, none overwritten
    assert killer.parts_before
    for name, sha in killer.parts_before.items():
        p = out / "trajectories" / name
        assert _sha(p) == sha, name
        assert pq.read_table(p).num_rows > 0
    new = [p for p in _parts(out) if p.name not in killer.parts_before]
    assert new and min(p.name for p in new) > max(killer.parts_before)
    rows = read_trajectories(out)
    steps = rows.column("step").to_pylist()
    # trained = what the final policy comes from: the first segment's rows of the steps
    # up to the checkpoint, then the second segment's (a step's rows carry the version it
    # trained on, one less than the version it made)
    before = sum(pq.read_table(out / "trajectories" / n).num_rows for n in killer.parts_before)
    kept_before = sum(
        1
        for n in killer.parts_before
        for v in pq.read_table(out / "trajectories" / n).column("step").to_pylist()
        if v < r["from_version"]
    )
    after = sum(pq.read_table(p).num_rows for p in new)
    assert len(steps) == before + after
    assert kept_before + after == s["trajectories_trained"]
    assert sorted(set(steps)) == list(range(5))


@pytest.mark.slow
def test_no_restart_left_is_one_line_and_exit_3(
    ray_local, tiny_model, tmp_path, monkeypatch, capsys
):
    import pyarrow.parquet as pq

    from asyncrl.train import execute

    out = tmp_path / "run"
    killer = RankKiller(monkeypatch, out, after=1)
    t0 = time.time()
    code = execute(cfg("max_steps=20", "fault.max_restarts=0"), out)
    took = time.time() - t0
    err = capsys.readouterr().err
    lines = _asyncrl_lines(err)
    print(f"max_restarts=0: exit {code} {took:.0f} s after the start, "
          f"{time.time() - killer.killed_at:.1f} s after the kill: {lines}")  # fmt: skip
    assert code == 3, err[-3000:]
    assert time.time() - killer.killed_at < 120  # not the broker's deadlines (~600 s)
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith("asyncrl: run failed: a learner rank died after version ")
    assert "fault.max_restarts=0: no restart left" in lines[0]
    assert len(killer.pids) == 1  # never restarted
    assert not (out / "summary.json").exists()
    assert killer.parts_before
    for name, sha in killer.parts_before.items():  # what was written before stays readable
        p = out / "trajectories" / name
        assert _sha(p) == sha and pq.read_table(p).num_rows > 0


@pytest.mark.slow
def test_a_dead_peer_rank_is_found_and_its_group_closed(ray_local, tmp_path):
    """Any rank, not only rank 0: with rank 1 SIGKILLed, rank 0's step fails in its
    collective (gloo sees the peer's socket close) and the driver's check names rank 1;
    the group closes without raising and frees its placement group. No vLLM here."""
    import ray
    from helpers import build_tiny_qwen, plain_optim, trajs

    from asyncrl.fault.learner import close_dead_learner, learner_death
    from asyncrl.learner.batch import collate
    from asyncrl.learner.config import LearnerSettings
    from asyncrl.learner.group import LearnerGroup
    from asyncrl.losses.advantages import GroupNormalized
    from asyncrl.losses.clipped import ClippedISLoss

    settings = LearnerSettings.defaults(world_size=2, micro_batch_tokens=40, collective_timeout_s=120,
                               optim=plain_optim(lr=1e-2))  # fmt: skip
    g = LearnerGroup(str(build_tiny_qwen(tmp_path / "m")), ClippedISLoss(), GroupNormalized(),
                     settings, seed=1)  # fmt: skip
    batch = collate(trajs(8, seed=1))
    try:
        g.step_on_batch(batch, 0)  # the group works
        assert learner_death(RuntimeError("not a death"), g) is None  # both alive
        os.kill(ray.get(g.ranks[1].pid.remote()), signal.SIGKILL)
        t0 = time.time()
        with pytest.raises(ray.exceptions.RayError) as e:
            ray.get(g.ranks[0].step_on_batch.remote(batch, 1))
        why = learner_death(e.value, g)
        took = time.time() - t0
    finally:
        close_dead_learner(SimpleNamespace(broker=None, learner=g))
    print(f"rank 1 killed: rank 0 failed and the check named it in {took:.1f} s: {why}")
    assert why is not None and why.startswith("rank 1: ActorDiedError"), why
    assert took < 30  # not the collective timeout (120 s here, 300 s by default)
    assert g.ranks == [] and g.pg is None


def test_the_ledger_keeps_steps_and_refuses_a_restart_past_the_limit(tmp_path):
    """No Ray: steps are kept by version (an evaluation's values are not a step); with
    fault.max_restarts=0 a death is one RunError line with the queue's accounting; the
    actors' fault entries of dead segments add up with the last one's."""
    from asyncrl.fault.learner import RestartLedger
    from asyncrl.loop import RunError

    class Sink:
        def __init__(self):
            self.steps = []

        def log(self, step, metrics):
            self.steps.append(step)

    sink = Sink()
    led = RestartLedger(sink, 0, tmp_path, None)
    for v in (1, 2, 3):
        led.log(v, {"reward/sum": 2.0 * v, "reward/count": 4.0, "tokens/trained": 10.0})
    led.log(3, {"eval/heldout/pass@1": 0.5})
    assert sink.steps == [1, 2, 3, 3] and led.steps == {
        1: (2.0, 4.0, 10), 2: (4.0, 4.0, 10), 3: (6.0, 4.0, 10)}  # fmt: skip
    q = {"produced": 10, "trained": 8, "dropped_stale": 0, "in_flight": 2}
    faults = {"actor_restarts": 1, "actor_restarts_by_actor": {"actor0": 1},
              "recovery_seconds": [30.0], "actor_events": [{"actor": "actor0"}]}  # fmt: skip
    with pytest.raises(RunError) as e:
        led.record_death("rank 0: ActorDiedError (surfaced as BrokerError)", time.time(), q,
                         {"actor0": {"tokens": 100}, "actor1": "stop failed"}, faults)  # fmt: skip
    assert str(e.value) == (
        "a learner rank died after version 3: rank 0: ActorDiedError (surfaced as "
        "BrokerError); fault.max_restarts=0: no restart left (newest complete checkpoint: "
        f"none); queue: produced 10, trained 8, dropped_stale 0, in_flight 2; outputs so "
        f"far: {tmp_path}"
    )
    assert led.tokens_before == 100 and led.restarts[0].died_after_version == 3
    last = {"actor_restarts": 2, "actor_restarts_by_actor": {"actor0": 1, "actor1": 1},
            "actors_dead": [], "groups_lost": 3, "recovery_seconds": [40.0, 50.0],
            "actor_events": [{"actor": "actor0"}, {"actor": "actor1"}]}  # fmt: skip
    merged = led.actor_faults(last)
    assert merged["actor_restarts"] == 3 and merged["groups_lost"] == 3
    assert merged["actor_restarts_by_actor"] == {"actor0": 2, "actor1": 1}
    assert merged["recovery_seconds"] == [30.0, 40.0, 50.0] and len(merged["actor_events"]) == 3
