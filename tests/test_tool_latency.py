"""A tool's latency (asyncrl/envs/latency.py): the lognormal has the median and 99th
percentile it is given, the same seed draws the same latencies, and the calculator env
with latency waits that long per call while the episodes of a group wait together."""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import pytest

from asyncrl.config import ConfigError
from asyncrl.envs.calculator import CalculatorEnv, CalculatorTask
from asyncrl.envs.latency import ToolLatency
from asyncrl.envs.settings import EnvSettings
from asyncrl.tasks.base import Prompt
from tests.test_envs import CALC, ScriptedEngine, calculator_policy, runner


def test_lognormal_has_its_median_and_p99_and_is_seeded():
    lat = ToolLatency(300, 2000)
    assert lat.draw(random.Random(7)) == ToolLatency(300, 2000).draw(random.Random(7))
    rng = random.Random(0)
    xs = sorted(lat.draw(rng) for _ in range(40_000))
    assert statistics.median(xs) == pytest.approx(0.300, rel=0.03)
    assert xs[int(0.99 * len(xs))] == pytest.approx(2.0, rel=0.08)
    assert statistics.fmean(xs) == pytest.approx(0.3 * 2.718281828 ** (lat.sigma**2 / 2), rel=0.03)
    assert ToolLatency(300, 300).draw(rng) == pytest.approx(0.3)  # p99 = median: fixed
    state = rng.getstate()
    assert ToolLatency().draw(rng) == 0.0 and rng.getstate() == state  # none: no draw


@pytest.mark.parametrize(
    "args, key",
    [({"tool_latency_median_ms": -1}, "env.tool_latency_median_ms"),
     ({"tool_latency_median_ms": 300, "tool_latency_p99_ms": 200}, "env.tool_latency_p99_ms"),
     ({"tool_latency_median_ms": 300, "tool_latency_p99_ms": "2s"}, "env.tool_latency_p99_ms")],
)  # fmt: skip
def test_bad_latency_settings_name_their_key(args, key):
    with pytest.raises(ConfigError, match=key):
        EnvSettings.from_config({"_target_": CALC.target, "max_turns": 3, **args})


def test_calculator_call_waits_its_latency_and_episodes_wait_together():
    """8 episodes of one group, each call ~100 ms (p99 200 ms): every episode awaited its
    env about that long (``episode.env_seconds``), the group took about one latency, not
    the sum of them, and the answers are still exact. Without latency: no wait."""
    group = asyncio.run(runner(ScriptedEngine(calculator_policy), CALC, n=2).run_group(
        Prompt("37*48=", "1776")))  # fmt: skip
    assert all(t.episode["env_seconds"] < 0.05 for t in group.trajectories)
    env = EnvSettings.defaults(
        target=CALC.target, max_turns=3, max_tokens=56,
        kwargs={"tool_latency_median_ms": 100, "tool_latency_p99_ms": 200},
    )  # fmt: skip
    run = runner(ScriptedEngine(calculator_policy), env, n=8)
    t0 = time.perf_counter()
    group = asyncio.run(run.run_group(Prompt("37*48=", "1776")))
    wall = time.perf_counter() - t0
    waits = [t.episode["env_seconds"] for t in group.trajectories]
    assert all(t.reward == 1.0 for t in group.trajectories)
    assert all(0.02 <= w <= 1.0 for w in waits) and len(set(waits)) > 1, waits
    assert wall < 0.75 * sum(waits), (wall, waits)  # overlapped: one group, one event loop


def test_latency_draws_repeat_with_the_seed_and_prompt():
    """The env's draws: from tool_latency_seed, the prompt and the episode's order."""

    async def waits(seed: int) -> list[float]:
        import asyncrl.envs.calculator as calc

        calc.EPISODES = iter(range(100))  # the same order of episodes each time
        out = []
        for _ in range(3):
            env = CalculatorEnv(2, 300, 2000, seed)
            await env.reset(Prompt("12*34=", "408"), CalculatorTask())
            out.append(env.latency.draw(env.rng))
        return out

    a, b, c = (asyncio.run(waits(s)) for s in (0, 0, 1))
    assert a == b and a != c and len(set(a)) == 3
