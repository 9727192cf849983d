"""The env/task's own reward as a component: the default ``reward`` config is exactly
this one with weight 1, so a default run's reward is the env's (the env computes
``env_reward``; this passes it on)."""

from __future__ import annotations

from asyncrl.rewards.base import Reward, RewardInput, RewardOutput


class TaskReward(Reward):
    """``value = env_reward``. Cheap and pure: runs in-process on the rollout actor
    (the pool's fast path, asyncrl/rewards/pool.py) when it is the only component."""

    name = "task"
    # it never waits: the combiner calls it without a timeout (a timer task per call
    # cost more than the reward itself on the fast path)
    timeout_s = float("inf")

    def __init__(self, name: str = "task"):
        self.name = name

    async def score(self, batch: list[RewardInput]) -> list[RewardOutput]:
        return [RewardOutput(value=float(x.env_reward)) for x in batch]
