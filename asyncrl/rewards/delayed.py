"""The task's reward after a delay: a stand-in for a remote verifier or a judge whose
answer takes ``delay_s`` per episode (benchmarks/reward.py measures what it costs the
generation path). Always scored on the reward workers, never on the fast path.

With ``period_s > 0`` the delay is switched on and off in turns of ``period_s`` seconds
of wall-clock time counted from ``epoch`` (Unix seconds; every worker reads the same
clock): instant in turns 0, 2, 4, ..., delayed in turns 1, 3, 5, ... So one run
measures both, interleaved, and a drift of the machine's speed over minutes falls on
both alike (:func:`delayed_at` says which a moment belongs to)."""

from __future__ import annotations

import asyncio
import math
import time

from asyncrl.rewards.base import Reward, RewardInput, RewardOutput


def delayed_at(t: float, epoch: float, period_s: float) -> bool:
    """Whether the delay is on at wall-clock time ``t`` (always, when ``period_s <= 0``)."""
    return period_s <= 0 or math.floor((t - epoch) / period_s) % 2 == 1


class DelayedTaskReward(Reward):
    """``value = env_reward``, each episode answered ``delay_s`` after the call (the
    episodes of a call wait concurrently, as requests to a service would); with
    ``period_s``, only in every other turn of ``period_s`` seconds from ``epoch``."""

    name = "delayed"

    def __init__(
        self, delay_s: float = 0.0, name: str = "delayed", max_batch: int = 64,
        timeout_s: float = 30.0, period_s: float = 0.0, epoch: float = 0.0,
    ):  # fmt: skip
        if delay_s < 0:
            raise ValueError(f"delay_s={delay_s}: must be >= 0")
        if period_s < 0:
            raise ValueError(f"period_s={period_s}: must be >= 0")
        self.delay_s, self.period_s, self.epoch = delay_s, period_s, epoch
        self.name, self.max_batch, self.timeout_s = name, max_batch, timeout_s

    async def score(self, batch: list[RewardInput]) -> list[RewardOutput]:
        delay = self.delay_s if delayed_at(time.time(), self.epoch, self.period_s) else 0.0

        async def one(x: RewardInput) -> RewardOutput:
            await asyncio.sleep(delay)
            return RewardOutput(value=float(x.env_reward))

        return list(await asyncio.gather(*(one(x) for x in batch)))
