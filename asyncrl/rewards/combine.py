"""Weighted combination of reward components: ``total = sum(weight x value)``.

    score(inputs): every component at once (asyncio.gather), each over chunks of at
                   most its ``max_batch`` episodes, each chunk bounded by its
                   ``timeout_s`` ─▶ per episode: total, breakdown, error

A component's failure (it raised, timed out, answered the wrong number of outputs, a
non-finite value, or set ``RewardOutput.error``) is that component's ``on_error`` value
and an error string on the episode, never an exception. Breakdown keys (logged
``reward/<key>``, kept in the trajectory log): ``<name>`` (the raw value),
``<name>/<key>`` (its sub-scores) and ``<name>_errors`` (1.0 when it failed).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any

from asyncrl.rewards.base import Reward, RewardInput, RewardOutput


@dataclass
class Scored:
    """One episode's combined reward."""

    total: float
    breakdown: dict[str, float] = field(default_factory=dict)
    error: str = ""
    contributions: dict[str, float] = field(default_factory=dict)  # name -> weight x value


def build_components(specs: list[tuple[dict[str, Any], float]]) -> list[tuple[Reward, float]]:
    """The components from ``RewardSettings.specs()`` (each built from ``_target_``)."""
    from asyncrl.config import build

    return [(build(f"reward.components[{i}]", s), w) for i, (s, w) in enumerate(specs)]


class Combiner:
    def __init__(self, components: list[tuple[Reward, float]], on_error: float = 0.0):
        self.components = components
        self.on_error = on_error

    async def score(self, inputs: list[RewardInput]) -> list[Scored]:
        if len(self.components) == 1:  # no task to create: the fast path's common case
            per = [await self._component(self.components[0][0], inputs)]
        else:
            per = await asyncio.gather(*(self._component(r, inputs) for r, _ in self.components))
        out = []
        for i in range(len(inputs)):
            s = Scored(total=0.0)
            errors = []
            for (r, w), outs in zip(self.components, per):
                o = outs[i]
                if w:  # a weight-0 component (a verifier) steers nothing
                    s.contributions[r.name] = w * o.value
                s.total += w * o.value
                s.breakdown[r.name] = o.value
                s.breakdown[f"{r.name}_errors"] = 1.0 if o.error else 0.0
                for k, v in o.components.items():
                    s.breakdown[f"{r.name}/{k}"] = float(v)
                if o.error:
                    errors.append(f"{r.name}: {o.error}")
            s.error = "; ".join(errors)
            out.append(s)
        return out

    async def _component(self, r: Reward, inputs: list[RewardInput]) -> list[RewardOutput]:
        size = max(1, int(r.max_batch))
        chunks = [inputs[i : i + size] for i in range(0, len(inputs), size)]
        if len(chunks) == 1:
            return await self._call(r, chunks[0])
        outs = await asyncio.gather(*(self._call(r, c) for c in chunks))
        return [o for chunk in outs for o in chunk]

    async def _call(self, r: Reward, chunk: list[RewardInput]) -> list[RewardOutput]:
        try:
            if math.isfinite(r.timeout_s):
                outs = await asyncio.wait_for(r.score(chunk), timeout=r.timeout_s)
            else:  # a component that never waits (TaskReward): no timer task per call
                outs = await r.score(chunk)
            if len(outs) != len(chunk):
                raise ValueError(f"answered {len(outs)} outputs for {len(chunk)} episodes")
        except TimeoutError:
            return self._failed(len(chunk), f"timed out after {r.timeout_s:g} s")
        except Exception as e:  # noqa: BLE001 - a user's reward must not crash the run
            return self._failed(len(chunk), f"{type(e).__name__}: {e}")
        return [self._checked(o) for o in outs]

    def _checked(self, o: Any) -> RewardOutput:
        if not isinstance(o, RewardOutput):
            return RewardOutput(self.on_error, error=f"not a RewardOutput: {type(o).__name__}")
        if o.error:
            return RewardOutput(self.on_error, dict(o.components), o.error)
        try:
            value = float(o.value)
        except (TypeError, ValueError):
            return RewardOutput(self.on_error, error=f"value {o.value!r} is not a number")
        if not math.isfinite(value):
            return RewardOutput(self.on_error, error=f"value {value} is not finite")
        return RewardOutput(value, dict(o.components))

    def _failed(self, n: int, why: str) -> list[RewardOutput]:
        return [RewardOutput(self.on_error, error=why) for _ in range(n)]

    async def close(self) -> None:
        for r, _ in self.components:
            try:
                await r.close()
            except Exception:  # noqa: BLE001, S110 - closing is best effort
                pass
