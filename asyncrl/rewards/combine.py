"""Weighted combination of reward components: ``total = sum(weight x value)``.

    score(inputs): every component at once (asyncio.gather), each over chunks of at
                   most its ``max_batch`` episodes, each chunk a call on the
                   component's lane bounded by its ``timeout_s`` (asyncrl/rewards/lane.py)
                   ─▶ per episode: total, breakdown, error

The fence: a component's failure is that component's ``on_error`` value and an error
string on each episode it failed, never an exception out of :meth:`Combiner.score`.
A failure is any of: it raised anything (``SystemExit``, ``KeyboardInterrupt`` and
other BaseExceptions included), it ran past ``timeout_s`` (also when it blocks
synchronously: it runs on its own thread), it answered the wrong number of outputs, or
an output is not a :class:`RewardOutput`, has a value that is not a finite number,
sub-scores that are not a mapping of names to finite numbers, or sets
``RewardOutput.error``. Every read of a component's answer happens on its lane too, so
the combining below touches only plain floats and strings.

Breakdown keys (logged ``reward/<key>``, kept in the trajectory log): ``<name>`` (the
raw value), ``<name>/<key>`` (its sub-scores) and ``<name>_errors`` (1.0 when it failed).
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from asyncrl.rewards.base import Reward, RewardInput, RewardOutput
from asyncrl.rewards.lane import ComponentFailed, Lane, describe, guarded

CLOSE_TIMEOUT_S = 60.0  # a component's close (a judge waits up to 30 s for its engine)
SHOWN_CHARS = 60  # of a bad value's repr in an error string


@dataclass
class Scored:
    """One episode's combined reward."""

    total: float
    breakdown: dict[str, float] = field(default_factory=dict)
    error: str = ""
    contributions: dict[str, float] = field(default_factory=dict)  # name -> weight x value


@dataclass
class Part:
    """One component as the combiner runs it: its limits read once, its lane."""

    reward: Reward
    weight: float
    name: str
    max_batch: int = 1
    timeout_s: float = math.inf
    broken: str = ""  # why every call fails at once (a limit that is not a number)
    lane: Lane = field(init=False)

    def __post_init__(self) -> None:
        self.lane = Lane(self.name)


def build_components(specs: list[tuple[dict[str, Any], float]]) -> list[tuple[Reward, float]]:
    """The components from ``RewardSettings.specs()`` (each built from ``_target_``)."""
    from asyncrl.config import build

    return [(build(f"reward.components[{i}]", s), w) for i, (s, w) in enumerate(specs)]


def part_of(r: Reward, weight: float) -> Part:
    """``r`` with its name and limits read and checked (reading them is its code too)."""
    try:
        name = r.name if isinstance(r.name, str) else type(r).__name__
    except BaseException:  # noqa: BLE001 - a name property that raises
        name = type(r).__name__
    try:
        size, timeout = number(r.max_batch), number(r.timeout_s)
        if size is None or not 1 <= size < math.inf:
            return Part(r, weight, name, broken=f"max_batch={shown(r.max_batch)}: expected >= 1")
        if timeout is None or not timeout > 0:
            return Part(r, weight, name, broken=f"timeout_s={shown(r.timeout_s)}: expected > 0")
    except BaseException as e:  # noqa: BLE001 - reading them ran the component's code
        return Part(r, weight, name, broken=f"its limits: {describe(e)}")
    return Part(r, weight, name, int(size), timeout)


class Combiner:
    def __init__(self, components: list[tuple[Reward, float]], on_error: float = 0.0):
        self.components = components
        self.on_error = on_error
        self.parts = [part_of(r, w) for r, w in components]

    async def score(self, inputs: list[RewardInput]) -> list[Scored]:
        if len(self.parts) == 1:  # no task to create: the fast path's common case
            per = [await self._part(self.parts[0], inputs)]
        else:
            per = await asyncio.gather(*(self._part(p, inputs) for p in self.parts))
        return [self._combined([outs[i] for outs in per]) for i in range(len(inputs))]

    def _combined(self, outs: list[RewardOutput]) -> Scored:
        """One episode: every output here is clean (float, dict[str, float], str)."""
        s = Scored(total=0.0)
        errors = []
        for p, o in zip(self.parts, outs):
            if p.weight:  # a weight-0 component (a verifier) steers nothing
                s.contributions[p.name] = p.weight * o.value
            s.total += p.weight * o.value
            s.breakdown[p.name] = o.value
            s.breakdown[f"{p.name}_errors"] = 1.0 if o.error else 0.0
            for k, v in o.components.items():
                s.breakdown[f"{p.name}/{k}"] = v
            if o.error:
                errors.append(f"{p.name}: {o.error}")
        s.error = "; ".join(errors)
        return s

    async def _part(self, p: Part, inputs: list[RewardInput]) -> list[RewardOutput]:
        chunks = [inputs[i : i + p.max_batch] for i in range(0, len(inputs), p.max_batch)]
        if len(chunks) == 1:
            return await self._call(p, chunks[0])
        outs = await asyncio.gather(*(self._call(p, c) for c in chunks))
        return [o for chunk in outs for o in chunk]

    async def _call(self, p: Part, chunk: list[RewardInput]) -> list[RewardOutput]:
        if p.broken:
            return self._failed(len(chunk), p.broken)

        async def work() -> list[RewardOutput]:  # on the lane: the component's code
            outs = p.reward.score(chunk)
            if inspect.isawaitable(outs):
                outs = await outs
            outs = list(outs)
            if len(outs) != len(chunk):
                raise ValueError(f"answered {len(outs)} outputs for {len(chunk)} episodes")
            return [checked(o, self.on_error) for o in outs]

        try:
            if math.isinf(p.timeout_s):  # it never waits (TaskReward): no thread, no timer
                return await guarded(work)
            return await p.lane.call(work, p.timeout_s)
        except ComponentFailed as e:
            return self._failed(len(chunk), str(e))

    def _failed(self, n: int, why: str) -> list[RewardOutput]:
        return [RewardOutput(self.on_error, error=why) for _ in range(n)]

    async def close(self) -> None:
        """Each component's ``close`` on its lane, bounded; failures ignored."""
        for p in self.parts:
            try:
                await p.lane.call(p.reward.close, CLOSE_TIMEOUT_S)
            except ComponentFailed:
                pass  # closing is best effort
            p.lane.close()


def checked(o: object, on_error: float) -> RewardOutput:
    """A clean copy of one output (a float value, a dict of str to finite floats, a str
    error), or ``on_error`` with the reason it is not one."""
    if not isinstance(o, RewardOutput):
        return RewardOutput(on_error, error=f"not a RewardOutput: {type(o).__name__}")
    subs, why = sub_scores(o.components)
    error = o.error
    if error is not None and not isinstance(error, str):
        return RewardOutput(on_error, error=f"error={shown(error)}: expected a string")
    if error:
        return RewardOutput(on_error, subs, error)
    if why:
        return RewardOutput(on_error, error=why)
    value = number(o.value)
    if value is None:
        return RewardOutput(on_error, error=f"value {shown(o.value)} is not a number")
    if not math.isfinite(value):
        return RewardOutput(on_error, error=f"value {value} is not finite")
    return RewardOutput(value, subs)


def sub_scores(components: object) -> tuple[dict[str, float], str]:
    """(name -> finite float, "") or ({}, why the sub-scores are refused)."""
    if not isinstance(components, Mapping):
        return {}, f"components is a {type(components).__name__}, not a dict of sub-scores"
    out = {}
    for k, v in components.items():
        f = number(v)
        if not isinstance(k, str):
            return {}, f"components key {shown(k)} is not a string"
        if f is None or not math.isfinite(f):
            return {}, f"components[{k!r}]={shown(v)} is not a finite number"
        out[k] = f
    return out, ""


def number(x: object) -> float | None:
    """``x`` as a float, or None for text and what ``float`` refuses."""
    if isinstance(x, str | bytes | bytearray):
        return None
    try:
        return float(x)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None


def shown(x: object) -> str:
    text = repr(x)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."
