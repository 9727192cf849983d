"""benchmarks/reward.py without its two runs (each starts a vLLM engine: minutes here):
its --quick arguments, the config each run composes, the window figures and the last
line's exact keys. The runs themselves: `python -m benchmarks.reward --quick`
(docs/rewards.md has the numbers)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks import reward as bench  # noqa: E402

KEYS = {"tokens_per_s_instant", "tokens_per_s_slow", "ratio", "reward_workers"}


def test_quick_arguments():
    args = bench.arguments(["--quick", "actor.max_inflight_groups=64"])
    assert (args.steps, args.warmup) == (40, 10)
    assert args.overrides == ["actor.max_inflight_groups=64"]
    with pytest.raises(SystemExit):
        bench.arguments(["--steps", "5", "--warmup", "5"])


@pytest.mark.parametrize("mode", list(bench.MODES))
def test_each_run_composes_the_default_job_with_its_delayed_reward(mode):
    from asyncrl.rewards.settings import RewardSettings
    from benchmarks.common import compose

    cfg = compose(bench.reward_override(bench.MODES[mode]))
    s = RewardSettings.from_config(cfg.reward)
    assert s.specs() == [({"_target_": bench.DELAYED, "delay_s": bench.MODES[mode]}, 1.0)]
    assert not s.inline and s.workers == 2  # both through the same pool of workers
    assert cfg.task._target_ == "asyncrl.tasks.arithmetic.AdditionTask"  # the default job


def test_window_figures_and_the_last_line(capsys):
    rec = bench.TimedRecorder()
    for step in range(1, 6):
        rec.log(step, {"tokens/trained": 100.0, "perf/wait_seconds": 0.1, "reward/mean": 0.5,
                       "staleness/mean": 1.0, "reward/errors": 0.0})  # fmt: skip
    rec.times = [0.0, 1.0, 2.0, 3.0, 5.0]  # the clock, set: steps 3..5 over 4 s
    row = bench.window_row("instant", rec, warmup=2)
    assert row["steps_timed"] == 3 and row["seconds"] == 4.0
    assert row["tokens_per_s"] == pytest.approx(300 / 4)
    assert row["learner_wait_frac"] == pytest.approx(0.3 / 4)
    slow = dict(row, tokens_per_s=60.0)
    figures = bench.figures_of([dict(row, reward_workers=2), dict(slow, reward_workers=2)])
    assert set(figures) == KEYS
    assert figures["ratio"] == pytest.approx(60.0 / 75.0) and figures["reward_workers"] == 2
    from benchmarks.common import emit_json

    emit_json(figures)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == figures
