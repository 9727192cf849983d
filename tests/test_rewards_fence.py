"""The fence around reward components (asyncrl/rewards/combine.py, lane.py): whatever a
component raises (BaseException included), answers (a wrong type, NaN, inf) or blocks
on, its episodes score ``on_error`` with the reason recorded, the scoring loop goes on,
and the next call is scored normally."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import numpy as np
import pytest

from asyncrl.rewards.base import Reward, RewardInput, RewardOutput
from asyncrl.rewards.combine import Combiner
from asyncrl.rewards.pool import RewardClient
from asyncrl.rewards.settings import RewardSettings
from asyncrl.rewards.task import TaskReward
from asyncrl.trajectory import Trajectory

BAD = "bad"  # the response that makes each hostile component misbehave


def inp(response: str = "ok", env_reward: float = 1.0) -> RewardInput:
    return RewardInput("1+1=", response, [1, 2], "2", {}, env_reward)


class Hostile(Reward):
    """Scores 2.0 with sub-score ``n`` = 1.0, except on a batch holding a ``BAD``
    response, where it does ``self.misbehave(batch)``."""

    name = "hostile"

    def misbehave(self, batch):
        raise NotImplementedError

    async def score(self, batch):
        if any(x.response == BAD for x in batch):
            return self.misbehave(batch)
        return [RewardOutput(2.0, {"n": 1.0}) for _ in batch]


def hostile(misbehave, **attrs) -> Hostile:
    return type("H", (Hostile,), {"misbehave": misbehave, **attrs})()


def _raise(e):
    def misbehave(self, batch):
        raise e

    return misbehave


def _answer(value=2.0, components=None, error=""):
    def misbehave(self, batch):
        return [RewardOutput(value, {} if components is None else components, error)
                for _ in batch]  # fmt: skip

    return misbehave


CASES = {
    "SystemExit": (_raise(SystemExit(3)), "SystemExit: 3"),
    "KeyboardInterrupt": (_raise(KeyboardInterrupt()), "KeyboardInterrupt"),
    "GeneratorExit": (_raise(GeneratorExit("closed")), "GeneratorExit: closed"),
    "its own CancelledError": (
        _raise(asyncio.CancelledError()),
        "CancelledError raised by the component",
    ),
    "a non-numeric sub-score": (
        _answer(components={"n": "high"}),
        "components['n']='high' is not a finite number",
    ),
    "a NaN sub-score": (
        _answer(components={"n": math.nan}),
        "components['n']=nan is not a finite number",
    ),
    "a non-string sub-score key": (
        _answer(components={3: 1.0}),
        "components key 3 is not a string",
    ),
    "non-dict components": (
        _answer(components=[("n", 1.0)]),
        "components is a list, not a dict of sub-scores",
    ),
    "a NaN score": (_answer(value=math.nan), "value nan is not finite"),
    "an inf score": (_answer(value=-math.inf), "value -inf is not finite"),
    "a text score": (_answer(value="2.0"), "value '2.0' is not a number"),
    "a None score": (_answer(value=None), "value None is not a number"),
    "a non-string error": (_answer(error=7), "error=7: expected a string"),
    "not a RewardOutput": (lambda self, batch: [2.0 for _ in batch], "not a RewardOutput: float"),
    "not a list": (lambda self, batch: None, "TypeError: 'NoneType' object is not iterable"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_misbehaving_component_scores_on_error_and_the_next_call_is_normal(case):
    misbehave, why = CASES[case]
    c = Combiner([(TaskReward(), 1.0), (hostile(misbehave), 0.5)], on_error=-4.0)

    async def main():
        first = await c.score([inp(BAD), inp(BAD, 0.0)])
        second = await c.score([inp("fine")])
        await c.close()
        return first, second

    first, second = asyncio.run(main())
    assert [s.total for s in first] == [1.0 - 2.0, 0.0 - 2.0]  # task + 0.5 x on_error
    assert [s.error for s in first] == [f"hostile: {why}"] * 2
    assert first[0].breakdown["hostile_errors"] == 1.0 and first[0].breakdown["task"] == 1.0
    assert all(math.isfinite(v) for v in first[0].breakdown.values())
    (s,) = second
    assert (s.total, s.error) == (1.0 + 1.0, "")
    assert s.breakdown == {"task": 1.0, "task_errors": 0.0, "hostile": 2.0,
                           "hostile_errors": 0.0, "hostile/n": 1.0}  # fmt: skip


class Blocks(Reward):
    """Blocks its thread synchronously (no await) for ``block_s`` on a ``BAD`` batch."""

    name = "blocks"
    timeout_s = 0.2

    def __init__(self, block_s: float):
        self.block_s = block_s

    async def score(self, batch):
        if any(x.response == BAD for x in batch):
            time.sleep(self.block_s)
        return [RewardOutput(3.0) for _ in batch]


def test_a_component_that_blocks_times_out_while_the_loop_goes_on():
    c = Combiner([(TaskReward(), 1.0), (Blocks(block_s=1.5), 1.0)], on_error=0.0)
    ticks = []

    async def ticker():
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    async def main():
        t = asyncio.get_running_loop().create_task(ticker())
        t0 = time.monotonic()
        first = await c.score([inp(BAD)])
        took = time.monotonic() - t0
        await asyncio.sleep(1.5)  # the lane's block ends; its timed-out call is dropped
        second = await c.score([inp("fine")])
        t.cancel()
        await c.close()
        return first, took, second, t0

    first, took, second, t0 = asyncio.run(main())
    assert first[0].error == "blocks: timed out after 0.2 s" and first[0].total == 1.0
    assert 0.2 <= took < 1.0  # the timeout fired: the caller did not wait for the block
    during = [x for x in ticks if t0 < x < t0 + took]
    assert len(during) >= 5  # the caller's loop kept running meanwhile
    assert (second[0].total, second[0].error) == (4.0, "")


def test_a_plain_function_score_that_blocks_is_fenced_too():
    class SyncBlocks(Reward):
        name = "sync"
        timeout_s = 0.2

        def score(self, batch):  # not a coroutine: runs on the lane all the same
            if any(x.response == BAD for x in batch):
                time.sleep(1.0)
            return [RewardOutput(5.0) for _ in batch]

    c = Combiner([(SyncBlocks(), 1.0)], on_error=-1.0)
    t0 = time.monotonic()
    (bad,) = asyncio.run(c.score([inp(BAD)]))
    assert time.monotonic() - t0 < 0.9
    assert (bad.total, bad.error) == (-1.0, "sync: timed out after 0.2 s")
    time.sleep(1.0)
    (good,) = asyncio.run(c.score([inp("fine")]))
    assert (good.total, good.error) == (5.0, "")


def test_each_component_runs_on_its_own_lane_and_the_task_reward_inline():
    seen = {}

    class Where(Reward):
        name = "where"

        async def score(self, batch):
            seen["thread"] = threading.current_thread().name
            return [RewardOutput(1.0) for _ in batch]

    asyncio.run(Combiner([(TaskReward(), 1.0), (Where(), 1.0)]).score([inp()]))
    assert seen["thread"] == "reward-lane-where"


def test_limits_that_are_not_numbers_fail_every_call_with_the_reason():
    c = Combiner([(hostile(_raise(RuntimeError()), timeout_s="soon"), 1.0)], on_error=0.5)
    (s,) = asyncio.run(c.score([inp()]))
    assert (s.total, s.error) == (0.5, "hostile: timeout_s='soon': expected > 0")
    c = Combiner([(hostile(_raise(RuntimeError()), max_batch=0), 1.0)], on_error=0.5)
    (s,) = asyncio.run(c.score([inp()]))
    assert s.error == "hostile: max_batch=0: expected >= 1"


class Exits(Hostile):
    """Importable by ``_target_``: ``SystemExit(3)`` on a ``BAD`` batch."""

    name = "exits"

    def misbehave(self, batch):
        raise SystemExit(3)


def traj() -> Trajectory:
    z = np.zeros(2)
    return Trajectory("t", "g", z, z, z, z, np.ones(2, bool), 0.0, {})


def test_the_rollout_actors_in_process_client_survives_systemexit():
    settings = RewardSettings.defaults(workers=0, on_error=-1.0, components=[
        {"_target_": "test_rewards_fence.Exits", "weight": 1.0},
        {"_target_": "asyncrl.rewards.task.TaskReward", "weight": 1.0}])  # fmt: skip
    settings.check()
    client = RewardClient(settings)
    assert not client.remote
    bad, good = [traj(), traj()], [traj()]

    async def main():
        await client.apply(bad, [inp(BAD), inp(BAD)])
        await client.apply(good, [inp("fine")])

    asyncio.run(main())
    assert [t.reward for t in bad] == [-1.0 + 1.0] * 2
    assert [t.error for t in bad] == ["exits: SystemExit: 3"] * 2
    assert (good[0].reward, good[0].error) == (2.0 + 1.0, "")
    assert client.stats["errors"] == 2 and client.stats["episodes"] == 3


@pytest.mark.slow  # a Ray actor: SystemExit in an actor's method would end the actor
def test_a_reward_worker_survives_systemexit_and_scores_the_next_call(ray_local):
    from asyncrl.rewards.pool import start_workers, stop_workers

    settings = RewardSettings.defaults(workers=1, on_error=-1.0, components=[
        {"_target_": "tests.test_rewards_fence.Exits", "weight": 1.0}])  # fmt: skip
    workers = start_workers(settings)
    try:
        client = RewardClient(settings, workers)
        bad, good = [traj()], [traj()]
        asyncio.run(client.apply(bad, [inp(BAD)]))
        asyncio.run(client.apply(good, [inp("fine")]))
    finally:
        stop_workers(workers)
    assert (bad[0].reward, bad[0].error) == (-1.0, "exits: SystemExit: 3")
    assert (good[0].reward, good[0].error) == (2.0, "")


def test_closing_with_a_call_in_flight_fails_that_call_not_the_caller():
    class Waits(Reward):
        name = "waits"
        timeout_s = 30.0

        async def score(self, batch):
            await asyncio.sleep(30)
            return [RewardOutput(1.0) for _ in batch]

    c = Combiner([(Waits(), 1.0)], on_error=-2.0)

    async def main():
        call = asyncio.get_running_loop().create_task(c.score([inp()]))
        await asyncio.sleep(0.2)  # the call is on the lane
        await c.close()
        return await call

    t0 = time.monotonic()
    (s,) = asyncio.run(main())
    assert time.monotonic() - t0 < 10
    assert (s.total, s.error) == (-2.0, "waits: cancelled on its lane (the lane closed)")
    (after,) = asyncio.run(c.score([inp()]))  # a closed combiner answers, never raises
    assert after.error == "waits: its lane is closed"
