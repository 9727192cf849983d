"""One short real training run (the CLI: Ray, a vLLM-CPU policy actor, the learner)
scored by the task's reward, the tiny reward model and the tiny judge at once: it
finishes, every trajectory is accounted, and TensorBoard has each component, the
judge's failures, and totals that are exactly the weighted sum of the components."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
BOTH = (
    "reward.components=[{_target_: asyncrl.rewards.task.TaskReward, weight: 1.0}, "
    "{_target_: asyncrl.rewards.rm.RewardModel, weight: 0.5, model: tiny}, "
    "{_target_: asyncrl.rewards.judge.Judge, weight: 0.25, model: tiny, timeout_s: 600}]"
)


def scalars(tb: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tb))
    ea.Reload()
    return {t: [e.value for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}


@pytest.mark.slow
def test_a_run_scored_by_task_rm_and_judge(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "asyncrl.train", "max_steps=3", "progress=false", "reward=judge",
         BOTH, f"hydra.run.dir={out}"],
        cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True,
        timeout=1200,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["steps"] == 3
    assert s["trajectories_produced"] == (
        s["trajectories_trained"] + s["trajectories_dropped_stale"] + s["trajectories_in_flight"]
    )
    m = scalars(out / "tb")
    for k in ("reward/task", "reward/rm", "reward/judge", "reward/judge_errors",
              "reward/rm_errors", "reward/judge/attempts"):  # fmt: skip
        assert len(m[k]) == 3, k
    assert m["reward/rm_errors"] == [0.0, 0.0, 0.0]
    assert all(0.0 <= e <= 1.0 for e in m["reward/judge_errors"])
    for i in range(3):  # a failed judge scores on_error (0), so the sum holds throughout
        want = m["reward/task"][i] + 0.5 * m["reward/rm"][i] + 0.25 * m["reward/judge"][i]
        assert m["reward/mean"][i] == pytest.approx(want, abs=1e-4)
