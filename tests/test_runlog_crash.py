"""A real ``python -m asyncrl.train`` SIGKILLed mid-run: every part file it finished
reads, the rows are whole steps in order, each with the learner's per-token record."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from asyncrl.utils.runlog import read_batches, read_trajectories, trajectory_parts

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[1]
BATCH_GROUPS, N = 4, 8  # trajectories per step: BATCH_GROUPS x actor.sampling.n
PART_EVERY = 2
WAIT_S = 600  # engine start-up (~25-60 s) and a few steps, on a loaded 2-core machine


def _descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_sigkilled_driver_leaves_every_finished_part(tmp_path, tiny_model):
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "asyncrl.train", f"hydra.run.dir={out}", "progress=false",
        "max_steps=200", f"learner.batch_groups={BATCH_GROUPS}", f"++log.part_every={PART_EVERY}",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log_file = open(tmp_path / "driver.log", "w")
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    started = []
    try:
        deadline = time.time() + WAIT_S
        while len(trajectory_parts(out)) < 3 and p.poll() is None and time.time() < deadline:
            time.sleep(1.0)
        assert p.poll() is None, (tmp_path / "driver.log").read_text()[-4000:]
        assert len(trajectory_parts(out)) >= 3, "no three parts in time"
        started = _descendants(p.pid)  # Ray, the actor's engine, the learner: ours to stop
        p.send_signal(signal.SIGKILL)  # no close, no flush: the crash the parts are for
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            started = started or _descendants(p.pid)
            p.kill()
            p.wait(timeout=30)
        for c in started:  # only what this test started, by pid
            try:
                c.kill()
            except Exception:  # noqa: BLE001 - already gone
                pass
        log_file.close()
    assert p.returncode == -signal.SIGKILL
    parts = trajectory_parts(out)
    steps: list[int] = []
    for f in parts:  # each finished part reads on its own
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
