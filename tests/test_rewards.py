"""The reward contract's combination (asyncrl/rewards/combine.py), the client's
in-process path and the per-group statistics: pure Python, no engine."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from asyncrl.rewards.base import Reward, RewardInput, RewardOutput
from asyncrl.rewards.combine import Combiner
from asyncrl.rewards.groupstats import dominant_share, dup_frac
from asyncrl.rewards.pool import RewardClient
from asyncrl.rewards.settings import RewardSettings
from asyncrl.rewards.task import TaskReward
from asyncrl.trajectory import Trajectory


def inp(env_reward: float = 1.0, response: str = "42", ids=(1, 2)) -> RewardInput:
    return RewardInput("1+1=", response, list(ids), "2", {"format": 1.0}, env_reward)


class Length(Reward):
    name = "length"

    async def score(self, batch):
        return [RewardOutput(len(x.response), {"chars": len(x.response)}) for x in batch]


class Boom(Reward):
    name = "boom"

    async def score(self, batch):
        raise RuntimeError("verifier down")


class Slow(Reward):
    name = "slow"
    timeout_s = 0.05

    async def score(self, batch):
        await asyncio.sleep(1.0)
        return [RewardOutput(1.0) for _ in batch]


class Short(Reward):
    name = "short"

    async def score(self, batch):
        return [RewardOutput(1.0)]  # one output whatever the batch: a contract breach


class Chunked(Reward):
    name = "chunked"
    max_batch = 2

    def __init__(self):
        self.calls: list[int] = []

    async def score(self, batch):
        self.calls.append(len(batch))
        return [RewardOutput(x.env_reward * 10) for x in batch]


def run(c: Combiner, xs):
    return asyncio.run(c.score(xs))


def test_weights_combine_and_the_breakdown_names_each_component():
    out = run(Combiner([(TaskReward(), 1.0), (Length(), 0.5)]), [inp(1.0, "abcd"), inp(0.0, "")])
    assert [s.total for s in out] == [1.0 + 0.5 * 4, 0.0]
    assert out[0].breakdown == {
        "task": 1.0, "task_errors": 0.0, "length": 4.0, "length_errors": 0.0, "length/chars": 4.0
    }  # fmt: skip
    assert out[0].contributions == {"task": 1.0, "length": 2.0}
    assert out[0].error == "" and out[1].error == ""


@pytest.mark.parametrize(
    "bad,why",
    [(Boom(), "boom: RuntimeError: verifier down"), (Slow(), "slow: timed out after 0.05 s"),
     (Short(), "short: ValueError: answered 1 outputs for 2 episodes")],
)  # fmt: skip
def test_a_failing_component_scores_on_error_and_is_recorded(bad, why):
    out = run(Combiner([(TaskReward(), 1.0), (bad, 2.0)], on_error=-0.5), [inp(1.0), inp(0.0)])
    assert [s.total for s in out] == [1.0 - 1.0, 0.0 - 1.0]  # 2.0 x on_error each
    assert all(s.error == why for s in out)
    assert out[0].breakdown[f"{bad.name}_errors"] == 1.0 and out[0].breakdown["task_errors"] == 0


def test_components_are_called_in_chunks_of_their_max_batch():
    c = Chunked()
    out = run(Combiner([(c, 1.0)]), [inp(float(i)) for i in range(5)])
    assert sorted(c.calls) == [1, 2, 2]
    assert [s.total for s in out] == [0.0, 10.0, 20.0, 30.0, 40.0]  # in input order


def test_an_error_or_nan_the_component_reports_itself_takes_the_policy():
    class Reports(Reward):
        name = "rep"

        async def score(self, batch):
            return [RewardOutput(5.0, error="judge said 'eleven'"), RewardOutput(float("nan"))]

    out = run(Combiner([(Reports(), 1.0)], on_error=0.25), [inp(), inp()])
    assert [s.total for s in out] == [0.25, 0.25]
    assert (
        out[0].error == "rep: judge said 'eleven'"
        and out[1].error == "rep: value nan is not finite"
    )


def traj(reward: float, err: str = "") -> Trajectory:
    z = np.zeros(2)
    return Trajectory("t", "g", z, z, z, z, np.ones(2, bool), reward, {"format": 1.0}, error=err)


def test_the_default_client_keeps_the_task_reward_and_writes_the_trajectories():
    settings = RewardSettings.defaults()
    assert settings.inline  # the default needs no worker
    client = RewardClient(settings)
    trajs = [traj(1.0), traj(0.0, "ValueError: no number")]
    asyncio.run(client.apply(trajs, [inp(1.0), inp(0.0)]))
    assert [t.reward for t in trajs] == [1.0, 0.0]  # exactly the env's reward, as before
    assert trajs[0].reward_breakdown["format"] == 1.0 and trajs[0].reward_breakdown["task"] == 1.0
    assert trajs[1].error == "ValueError: no number"  # the env's error kept, none added
    assert "dominant_share" not in trajs[0].reward_breakdown  # one component: no share


def test_group_statistics():
    long_a, long_b = list(range(20)), list(range(20))
    near = list(range(19)) + [99]
    other = list(range(100, 120))
    assert dup_frac([long_a, long_b, near, other], min_tokens=8, near=0.8) == 0.5
    assert dup_frac([[1, 2], [1, 2], [1, 2]], min_tokens=8, near=0.9) == 0.0  # short answers
    assert dominant_share([{"a": 1.0, "b": -3.0}, {"a": 1.0, "b": 5.0}]) == pytest.approx(0.8)
    assert dominant_share([{"a": 1.0}]) is None
