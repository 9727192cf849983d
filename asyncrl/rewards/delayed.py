"""The task's reward after a delay: a stand-in for a remote verifier or a judge whose
answer takes ``delay_s`` per episode (benchmarks/reward.py measures what it costs the
generation path). Always scored on the reward workers, never on the fast path."""

from __future__ import annotations

import asyncio

from asyncrl.rewards.base import Reward, RewardInput, RewardOutput


class DelayedTaskReward(Reward):
    """``value = env_reward``, each episode answered ``delay_s`` after the call (the
    episodes of a call wait concurrently, as requests to a service would)."""

    name = "delayed"

    def __init__(
        self, delay_s: float = 0.0, name: str = "delayed", max_batch: int = 64,
        timeout_s: float = 30.0,
    ):  # fmt: skip
        if delay_s < 0:
            raise ValueError(f"delay_s={delay_s}: must be >= 0")
        self.delay_s, self.name, self.max_batch, self.timeout_s = delay_s, name, max_batch, timeout_s

    async def score(self, batch: list[RewardInput]) -> list[RewardOutput]:
        async def one(x: RewardInput) -> RewardOutput:
            await asyncio.sleep(self.delay_s)
            return RewardOutput(value=float(x.env_reward))

        return list(await asyncio.gather(*(one(x) for x in batch)))
