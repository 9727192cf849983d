"""benchmarks/reward.py without its runs (each starts a vLLM engine: minutes here): its
--quick arguments, the config each run composes, the turns of the interleaved run, the
window figures and the last line's exact keys. The runs themselves: `python -m benchmarks.reward --quick`
(docs/rewards.md has the numbers)."""

from __future__ import annotations

import json
import math
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
    assert (args.steps, args.warmup, args.separate) == (300, 10, False)
    assert (args.period, args.settle) == (bench.PERIOD_S, bench.SETTLE_S)
    assert args.overrides == ["actor.max_inflight_groups=64"]
    assert bench.arguments(["--quick", "--separate"]).steps == 40
    with pytest.raises(SystemExit):
        bench.arguments(["--steps", "5", "--warmup", "5"])
    with pytest.raises(SystemExit):
        bench.arguments(["--period", "5", "--settle", "5"])


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
    assert KEYS <= set(figures)
    assert figures["ratio"] == pytest.approx(60.0 / 75.0) and figures["reward_workers"] == 2
    assert figures.pop("method") == "separate"
    from benchmarks.common import emit_json

    emit_json(figures)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == figures


def test_the_interleaved_run_composes_one_reward_that_takes_turns():
    from asyncrl.rewards.settings import RewardSettings
    from benchmarks.common import compose

    cfg = compose(bench.reward_override(0.2, 10.0, 1000.5))
    ((spec, weight),) = RewardSettings.from_config(cfg.reward).specs()
    assert spec == {"_target_": bench.DELAYED, "delay_s": 0.2, "period_s": 10.0, "epoch": 1000.5}


async def test_the_delayed_reward_is_slow_only_in_odd_turns(monkeypatch):
    from asyncrl.rewards import delayed
    from asyncrl.rewards.base import RewardInput

    assert [delayed.delayed_at(t, 100.0, 10.0) for t in (100, 109.9, 110, 119.9, 120)] == [
        False, False, True, True, False,
    ]  # fmt: skip
    assert delayed.delayed_at(5.0, 100.0, 0.0)  # no period: always
    with pytest.raises(ValueError, match="period_s=-1"):
        delayed.DelayedTaskReward(delay_s=0.2, period_s=-1)
    r = delayed.DelayedTaskReward(delay_s=0.3, period_s=10.0, epoch=100.0)
    x = RewardInput(prompt="1+1=", response="2", response_ids=[5], answer="2", info={},
                    env_reward=1.0)  # fmt: skip
    for now, want in ((104.0, 0.0), (113.0, 0.3)):
        slept = []

        async def sleep(s, slept=slept):
            slept.append(s)

        monkeypatch.setattr(delayed.time, "time", lambda now=now: now)
        monkeypatch.setattr(delayed.asyncio, "sleep", sleep)
        out = await r.score([x, x])
        assert [o.value for o in out] == [1.0, 1.0] and slept == [want, want]


def test_turns_count_only_settled_steps_and_pair_each_slow_turn_with_its_neighbours():
    """Steps every 0.5 s from t=100.25 (epoch 100, 4 s turns, 1 s settling): a step is
    counted in the turn it ended in if it began >= 1 s into that turn."""
    rec = bench.TimedRecorder()
    for i in range(33):  # 100.25 .. 116.25
        tokens = 100.0 if math.floor((100.25 + 0.5 * i - 100) / 4) % 2 == 0 else 80.0
        rec.log(i + 1, {"tokens/trained": tokens, "perf/wait_seconds": 0.05, "reward/mean": 0.5,
                        "staleness/mean": 1.0, "reward/errors": 0.0})  # fmt: skip
    rec.wall = [100.25 + 0.5 * i for i in range(33)]
    rows = bench.turn_rows(rec, warmup=2, epoch=100.0, period_s=4.0, settle_s=1.0)
    assert [(r["turn"], r["mode"]) for r in rows] == [
        (0, "instant"), (1, "slow"), (2, "instant"), (3, "slow"),
    ]  # fmt: skip
    # turn 1 is [104, 108): steps ending 105.75 .. 107.75 began >= 105: 5 steps, 2.5 s
    assert rows[1]["steps_timed"] == 5 and rows[1]["seconds"] == pytest.approx(2.5)
    assert rows[1]["tokens_per_s"] == pytest.approx(80 * 5 / 2.5)
    assert rows[0]["steps_timed"] == 5  # warm-up: steps 1-2 (ending 100.25, 100.75) never count
    figures = bench.interleaved_figures(rows, workers=2)
    assert KEYS <= set(figures) and figures["method"] == "interleaved"
    assert figures["ratio"] == pytest.approx(0.8)
    assert figures["turns_instant"] == figures["turns_slow"] == 2
    assert figures["ratio_pairs_min"] == figures["ratio_pairs_max"] == pytest.approx(0.8)
