"""``asyncrl-replay``: the learner's steps again from a kept checkpoint, on the batches the
run trained on; on the CPU with one rank, loss and grad norm equal the logged ones bit
for bit, for 10 steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_inspect import EVERY, STEPS, tool_run

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model):
    return tool_run(tmp_path_factory)


def test_ten_steps_replay_bit_for_bit(run_dir):
    from asyncrl.tools.replay import replay
    from asyncrl.utils.runlog import read_batches

    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == sorted(
        f"step-{s}" for s in range(EVERY, STEPS + 1, EVERY)
    )
    rows = replay(run_dir, EVERY, 10)
    logged = read_batches(run_dir, full=True)
    assert [r["step"] for r in rows] == list(range(EVERY, EVERY + 10))
    for r in rows:
        assert r["logged_loss"] == logged[r["step"]]["loss/total"]
        assert r["loss"] == r["logged_loss"], r  # bit for bit
        assert r["grad_norm"] == r["logged_grad_norm"], r
        assert r["grad_norm"] > 0


def test_cli_prints_the_table_and_a_json_verdict(run_dir):
    r = subprocess.run(
        [sys.executable, "-m", "asyncrl.tools.replay", str(run_dir), "--from-step", "4",
         "--steps", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    verdict = json.loads(r.stdout.strip().splitlines()[-1])
    assert verdict == {"steps": 3, "from_step": 4, "bit_equal": True, "max_abs_loss_diff": 0.0,
                       "max_abs_grad_norm_diff": 0.0}  # fmt: skip
    assert sum(ln.rstrip().endswith("yes") for ln in r.stdout.splitlines()) == 3


def test_no_checkpoint_at_the_step_says_so(run_dir):
    r = subprocess.run(
        [sys.executable, "-m", "asyncrl.tools.replay", str(run_dir), "--from-step", "3", "--steps", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2
    assert "no checkpoint at step 3" in r.stderr and "log.keep_checkpoints=true" in r.stderr
