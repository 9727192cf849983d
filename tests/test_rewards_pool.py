"""The reward workers (real Ray actors, asyncrl/rewards/pool.py) as a rollout actor
uses them: groups finishing together go in one call, scores come back in order, and a
component that times out or a worker that died is a recorded error scored
reward.on_error, never an exception in the actor."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from asyncrl.rewards.base import RewardInput
from asyncrl.rewards.delayed import DelayedTaskReward
from asyncrl.rewards.pool import RewardClient, launch_workers, start_workers, stop_workers
from asyncrl.rewards.settings import RewardSettings
from asyncrl.trajectory import Trajectory

pytestmark = pytest.mark.slow  # starts Ray actors

DELAYED = "asyncrl.rewards.delayed.DelayedTaskReward"


def group(n: int, base: float) -> tuple[list[Trajectory], list[RewardInput]]:
    z = np.zeros(1)
    trajs = [Trajectory(f"t{i}", "g", z, z, z, z, np.ones(1, bool), 0.0) for i in range(n)]
    inputs = [RewardInput("p", "r", [1], None, {}, base + i) for i in range(n)]
    return trajs, inputs


def settings(**component) -> RewardSettings:
    return RewardSettings.defaults(workers=2, on_error=-1.0, components=[{"_target_": DELAYED,
                                                                 "weight": 2.0, **component}])  # fmt: skip


def test_groups_finishing_together_share_one_call_and_keep_their_order(ray_local):
    s = settings(delay_s=0.05)
    workers = start_workers(s)
    try:
        client = RewardClient(s, workers)
        groups = [group(4, 10.0 * g) for g in range(3)]

        async def main():
            await asyncio.gather(*(client.apply(t, i) for t, i in groups))

        asyncio.run(main())
        assert client.stats["calls"] == 1 and client.stats["episodes"] == 12
        for g, (trajs, _) in enumerate(groups):
            assert [t.reward for t in trajs] == [2.0 * (10.0 * g + i) for i in range(4)]
            assert all(t.reward_breakdown["delayed"] == 10.0 * g + i for i, t in enumerate(trajs))
            assert all(t.error == "" for t in trajs)
    finally:
        stop_workers(workers)


def test_a_timeout_and_a_dead_worker_are_recorded_not_raised(ray_local):
    import ray

    s = settings(delay_s=2.0, timeout_s=0.1)
    workers = start_workers(s)
    try:
        client = RewardClient(s, workers)
        trajs, inputs = group(3, 1.0)
        asyncio.run(client.apply(trajs, inputs))
        assert [t.reward for t in trajs] == [-2.0] * 3  # weight x on_error
        assert all(t.error == "delayed: timed out after 0.1 s" for t in trajs)
        assert all(t.reward_breakdown["delayed_errors"] == 1.0 for t in trajs)
        for w in workers:
            ray.kill(w, no_restart=True)
        trajs, inputs = group(2, 1.0)
        asyncio.run(client.apply(trajs, inputs))
        assert [t.reward for t in trajs] == [-1.0, -1.0]  # the call's on_error
        assert all(t.error.startswith("reward worker ") for t in trajs), trajs[0].error
    finally:
        stop_workers(workers)


def test_the_task_reward_alone_starts_no_worker(ray_local):
    assert start_workers(RewardSettings.defaults()) == []


class SlowBuild(DelayedTaskReward):
    """A component that takes ``build_s`` to build, as a judge's engine does."""

    def __init__(self, build_s: float = 0.0, **kw):
        time.sleep(build_s)
        super().__init__(**kw)


def test_launched_workers_build_in_the_background_and_a_bad_one_raises_on_its_ref(ray_local):
    """launch_workers returns before the workers are built (the run starts its engines
    meanwhile); the refs resolve once they are, and a bad component raises there."""
    import ray

    slow = {"_target_": "tests.test_rewards_pool.SlowBuild", "weight": 1.0, "build_s": 4.0}
    s = RewardSettings.defaults(workers=1, components=[slow])
    t0 = time.monotonic()
    workers, built = launch_workers(s)
    try:
        assert time.monotonic() - t0 < 2.0 and len(workers) == len(built) == 1
        assert ray.wait(built, timeout=0.5)[0] == []  # still building
        assert ray.get(built, timeout=120) == [30.0]  # the component's timeout_s
    finally:
        stop_workers(workers)
    bad = RewardSettings.defaults(workers=1, components=[{**slow, "build_s": 0.0, "delay_s": -1}])
    workers, built = launch_workers(bad)
    try:
        with pytest.raises(Exception, match=r"delay_s=-1"):
            ray.get(built, timeout=120)
    finally:
        stop_workers(workers)
