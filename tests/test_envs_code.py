"""env=code grades through the actor's SandboxPool (``sandbox.workers``): at most that
many programs run at once, the event loop keeps running while they do, the rewards are
the sandbox's grades, and a hostile program is a grade of 0, not a failed run. A
scripted engine stands in for vLLM (the process boundary); the sandbox is real."""

from __future__ import annotations

import asyncio
import pickle
import string
import threading
import time

import pytest
from test_envs import ScriptedEngine

import asyncrl.sandbox.pool as pool_module
from asyncrl.actor.env_runner import MultiTurnEpisodes
from asyncrl.actor.settings import ActorSettings
from asyncrl.config import ConfigError
from asyncrl.engine.settings import EngineSettings, SamplingSettings
from asyncrl.envs.code import CodeEnv, CodeTask
from asyncrl.envs.settings import EnvSettings
from asyncrl.models.tiny import build_tokenizer
from asyncrl.sandbox import SandboxPool, SandboxSettings
from asyncrl.tasks.base import Prompt

pytestmark = pytest.mark.slow  # real sandboxed processes, several seconds

TOK = build_tokenizer(string.printable)
CASES = [{"call": "add(1, 2)", "expected": 3}, {"call": "add(2, 5)", "expected": 7}]
PROMPT = Prompt("# add(a, b): the sum of a and b\n", "", meta={"cases": CASES})
RIGHT = "import time\ntime.sleep(0.4)\ndef add(a, b): return a + b"  # ~1 s a grading
WRONG = "def add(a, b): return a - b"
HOSTILE = "import os\nwhile True:\n    os.fork()"  # a fork bomb


def code_env(workers: int, max_attempts: int = 1) -> EnvSettings:
    return EnvSettings.from_config(
        {"_target_": "asyncrl.envs.code.CodeEnv", "max_turns": 2, "max_tokens": 200,
         "max_attempts": max_attempts},
        {"workers": workers, "timeout_s": 4.0},
    )  # fmt: skip


def runner(engine, env: EnvSettings, n: int) -> MultiTurnEpisodes:
    settings = ActorSettings.defaults(
        sampling=SamplingSettings.defaults(n=n, max_tokens=120),
        engine=EngineSettings.defaults(max_model_len=256),
    )
    return MultiTurnEpisodes(engine, CodeTask(), settings, env, lambda: 0)


def by_request(answers: list[str]):
    """The k-th request of the run gets ``answers[k]`` (n episodes of one group ask in
    order, each once with max_attempts=1)."""
    count = {"k": 0}

    def policy(ids: list[int]) -> str:
        k = count["k"]
        count["k"] += 1
        return answers[k % len(answers)]

    return policy


class Concurrency:
    """Wraps the pool's grading call (the real one runs): how many run at once."""

    def __init__(self, real):
        self.real, self.now, self.most, self.lock = real, 0, 0, threading.Lock()
        self.walls: list[float] = []  # seconds each grading took

    def __call__(self, *args, **kwargs):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        t0 = time.monotonic()
        try:
            return self.real(*args, **kwargs)
        finally:
            with self.lock:
                self.now -= 1
                self.walls.append(time.monotonic() - t0)


async def _with_ticker(coro):
    """Run ``coro`` while a ticker sleeps 10 ms at a time: the longest the event loop
    went without running it (a blocking grading would stall it for a whole grading)."""
    gaps, done = [0.0], asyncio.Event()

    async def tick():
        last = time.monotonic()
        while not done.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    try:
        out = await coro
    finally:
        done.set()
        await ticker
    return out, max(gaps)


@pytest.mark.parametrize("workers", [1, 3])
def test_grading_concurrency_is_bounded_by_workers(workers, monkeypatch):
    counter = Concurrency(pool_module.grade_with)
    monkeypatch.setattr(pool_module, "grade_with", counter)
    env = code_env(workers)
    n = 6
    engine = ScriptedEngine(by_request([RIGHT, WRONG]), tok=TOK)
    t0 = time.monotonic()
    group, worst_gap = asyncio.run(_with_ticker(runner(engine, env, n).run_group(PROMPT)))
    wall = time.monotonic() - t0
    env.close()
    assert counter.most == workers  # all six were waiting: the pool ran exactly `workers`
    rewards = [t.reward for t in group.trajectories]
    assert sorted(rewards) == [0.0] * 3 + [1.0] * 3
    for t in group.trajectories:
        assert t.finish_reason == "done" and not t.error
        assert t.reward_breakdown["passed"] == 2 * t.reward
        assert t.episode["tool_calls"] == 1
    # the loop ran all along: a grading on the loop would stall it for a whole grading
    # (the shortest here ~0.3 s, ~1 s for the right ones on a quiet machine; longer
    # under load, and so is the bound)
    assert len(counter.walls) == n
    assert worst_gap < 0.5 * max(counter.walls), (worst_gap, counter.walls, wall)


def test_a_hostile_program_scores_zero_and_the_run_goes_on():
    env = code_env(workers=2)
    engine = ScriptedEngine(by_request([HOSTILE, RIGHT]), tok=TOK)
    r = runner(engine, env, n=2)
    t0 = time.monotonic()
    bad, good = asyncio.run(r.run_group(PROMPT)).trajectories
    assert time.monotonic() - t0 < 4.0 + 10  # within the sandbox's limit and its grace
    assert bad.reward == 0.0 and bad.finish_reason == "done" and not bad.error
    assert bad.reward_breakdown["sandbox_error"] == 1.0
    assert good.reward == 1.0 and good.reward_breakdown["sandbox_error"] == 0.0
    # the next group, on the same pool, is graded as usual
    engine.policy = by_request([RIGHT, WRONG])
    after = asyncio.run(r.run_group(PROMPT)).trajectories
    assert [t.reward for t in after] == [1.0, 0.0]
    stats = env.pool().stats()
    env.close()
    assert stats["sandbox/execs"] == 4 and stats["sandbox/errors"] == 1


def test_the_env_gets_one_pool_of_sandbox_workers_per_process():
    env = code_env(workers=3)
    a, b = env.make(), env.make()
    assert isinstance(a, CodeEnv) and a.sandbox is b.sandbox
    assert isinstance(a.sandbox, SandboxPool) and a.sandbox.settings.workers == 3
    shipped = pickle.loads(pickle.dumps(env))  # to an actor: settings, never the pool
    assert shipped._pool is None and shipped.sandbox == env.sandbox
    assert shipped.make().sandbox is not a.sandbox
    env.close()
    shipped.close()
    with pytest.raises(ConfigError, match="sandbox.workers=0"):
        code_env(workers=0)
    with pytest.raises(ConfigError, match="env.sandbox"):
        EnvSettings.from_config({"_target_": "asyncrl.envs.code.CodeEnv", "sandbox": 1})
    plain = EnvSettings.from_config({"_target_": "asyncrl.envs.calculator.CalculatorEnv"})
    assert plain.sandbox == SandboxSettings.defaults() and plain._pool is None
