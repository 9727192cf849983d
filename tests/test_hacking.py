"""Reward-hacking defences (asyncrl/rewards/shaping.py) and monitors
(asyncrl/monitor/hacking.py, run by the run-health monitor): pure Python, synthetic
metric streams shaped like a length hack and like an honest run."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

from asyncrl.monitor import HealthMonitor, MonitorSettings
from asyncrl.monitor.hacking import HackingSettings
from asyncrl.rewards.base import RewardInput
from asyncrl.rewards.shaping import LengthReward, OverlongPenalty, StrictAnswer, strict_answer


def inp(response: str, answer="25", n_ids: int | None = None) -> RewardInput:
    ids = list(range(n_ids if n_ids is not None else len(response)))
    return RewardInput("12+13=", response, ids, answer, {}, 0.0)


@pytest.mark.parametrize(
    "response,value,several",
    [("25", 1.0, 0.0), (" 25 ", 1.0, 0.0), ("24", 0.0, 0.0), ("", 0.0, 0.0),
     ("25 26", 0.0, 1.0), ("26 25", 0.0, 1.0), ("25+1=26", 0.0, 1.0), ("the sum is 25", 1.0, 0.0)],
)  # fmt: skip
def test_strict_answer_takes_one_final_answer_never_the_first_of_several(response, value, several):
    (out,) = asyncio.run(StrictAnswer().score([inp(response)]))
    assert out.value == value and out.components == {"several": several}
    assert strict_answer("1 2") is None and strict_answer("x7y") == "7"


def test_overlong_penalty_is_dapos_soft_punishment():
    p = OverlongPenalty(max_tokens=10, buffer_tokens=4, factor=0.5)
    assert [p.penalty(n) for n in (1, 6, 7, 8, 10, 12)] == [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]
    outs = asyncio.run(p.score([inp("x", n_ids=6), inp("x", n_ids=9)]))
    assert [o.value for o in outs] == [0.0, -0.375]
    with pytest.raises(ValueError, match="buffer_tokens"):
        OverlongPenalty(max_tokens=4, buffer_tokens=5)
    assert asyncio.run(LengthReward(0.5).score([inp("abc")]))[0].value == 1.5


WARMUP, STEPS, HACK_FROM = 10, 60, 20


def stream(hack: bool, seed: int = 0) -> list[dict[str, float]]:
    """Step metrics of a run on the length_hack reward: honest, task reward and verifier
    rise together and lengths stay put; hacked from HACK_FROM, the length bonus (and so
    the reward) climbs while the strict verifier stays flat."""
    rng = np.random.default_rng(seed)
    rows = []
    for step in range(1, STEPS + 1):
        acc = min(0.8, 0.3 + 0.005 * step) + rng.normal(0, 0.02)
        length = 3.0 + rng.normal(0, 0.05)
        if hack and step >= HACK_FROM:
            acc = 0.3 + rng.normal(0, 0.02)
            length = min(6.0, 3.0 + 0.15 * (step - HACK_FROM))
        bonus = 0.5 * length
        rows.append({
            "reward/mean": acc + bonus, "reward/task": acc, "reward/strict": acc,
            "reward/length": length * 0.5, "response_length/mean": length,
            "reward/dominant_share": bonus / (bonus + acc), "reward/dup_frac": 0.0,
        })  # fmt: skip
    return rows


def monitor(rows, **hacking) -> tuple[HealthMonitor, list[dict[str, float]]]:
    mon = HealthMonitor(
        MonitorSettings.defaults(warmup_steps=WARMUP), 0, HackingSettings.defaults(**hacking)
    )
    return mon, [mon.check(step, m) for step, m in enumerate(rows, start=1)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_an_honest_run_stays_quiet(seed):
    mon, out = monitor(stream(hack=False, seed=seed))
    assert mon.warnings == [], mon.warnings
    assert all(o[k] == 0.0 for o in out for k in o if k.startswith("alerts/hacking_"))
    assert out[-1]["hacking/reward_rise"] > 0.1 and out[-1]["hacking/verifier_rise"] > 0.1


def test_a_length_hack_fires_within_a_bounded_number_of_steps(caplog):
    with caplog.at_level(logging.WARNING, logger="asyncrl.monitor"):
        mon, out = monitor(stream(hack=True), dominance_max=0.85)
    first = {n: mon.fired[n]["first_step"] for n in mon.fired}
    assert set(first) == {"hacking_verifier_gap", "hacking_length_drift", "hacking_dominance"}
    assert all(HACK_FROM < s <= HACK_FROM + 15 for s in first.values()), first
    lines = [r.getMessage() for r in caplog.records]
    gap = [line for line in lines if "hacking_verifier_gap" in line]
    assert f"at step {first['hacking_verifier_gap']}:" in gap[0]  # then quiet for the cooldown
    assert "learning the reward, not the task" in gap[0]
    assert out[first["hacking_length_drift"] - 1]["alerts/hacking_length_drift"] == 1.0


def test_duplicates_climbing_fire_and_steady_duplicates_do_not():
    rows = [{"reward/dup_frac": 0.1 if step < 30 else 0.7} for step in range(1, 50)]
    mon, _ = monitor(rows)
    assert mon.fired["hacking_duplicates"]["first_step"] in range(30, 36)
    mon, _ = monitor([{"reward/dup_frac": 0.7} for _ in range(50)])  # always so: no climb
    assert "hacking_duplicates" not in mon.fired


def test_bad_hacking_settings_name_their_key():
    from asyncrl.config import ConfigError

    with pytest.raises(
        ConfigError, match=r"reward.monitor.length_factor=1.0: expected a number > 1"
    ):
        HackingSettings.defaults(length_factor=1.0)
