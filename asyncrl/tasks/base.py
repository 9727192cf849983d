"""Tasks: where prompts come from and how completions are scored.

A task is any object with ``sample(rng) -> Prompt`` and
``reward(prompt, completion) -> float | dict[str, float]`` (a dict must hold the key
``"reward"``; the other keys are logged as ``reward/<key>``). Built from ``_target_``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class Prompt:
    text: str
    answer: str = ""  # reference answer, if the task has one (used for the warm start)
    meta: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Task(Protocol):
    def sample(self, rng: random.Random) -> Prompt: ...

    def reward(self, prompt: Prompt, completion: str) -> float | dict[str, float]: ...


class TaskSampler:
    """Seeded, resumable stream of prompts: ``state_dict`` / ``load_state_dict`` restore
    exactly the same continuation."""

    def __init__(self, task: Task, seed: int = 0):
        self.task = task
        self.seed = seed
        self._rng = random.Random(seed)
        self.drawn = 0

    def next(self) -> Prompt:
        self.drawn += 1
        return self.task.sample(self._rng)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "drawn": self.drawn, "rng": self._rng.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed, self.drawn = state["seed"], state["drawn"]
        self._rng.setstate(_as_tuple(state["rng"]))


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, list | tuple) else x


Scored = tuple[float, dict[str, float], str]  # (reward, breakdown, error text or "")


def score(task: Task, prompt: Prompt, completion: str) -> Scored:
    """Run the task's reward; a crash is recorded (reward 0, error text), never raised."""
    try:
        return _scored(task.reward(prompt, completion))
    except Exception as e:  # noqa: BLE001 - a user's reward must not kill the actor
        return 0.0, {}, f"{type(e).__name__}: {e}"


async def ascore(task: Task, prompt: Prompt, completion: str) -> Scored:
    """:func:`score` for callers on an event loop: a task whose reward waits on another
    process (``areward``, e.g. the code task's sandbox) is awaited, never run inline;
    any other task's ``reward`` is called directly (a cheap, pure function)."""
    areward = getattr(task, "areward", None)
    if areward is None:
        return score(task, prompt, completion)
    try:
        return _scored(await areward(prompt, completion))
    except Exception as e:  # noqa: BLE001 - a user's reward must not kill the actor
        return 0.0, {}, f"{type(e).__name__}: {e}"


def _scored(out: float | dict[str, float]) -> Scored:
    if isinstance(out, dict):
        breakdown = {k: float(v) for k, v in out.items()}
        return breakdown.pop("reward"), breakdown, ""
    return float(out), {}, ""


def digit_credit(got: str, want: str, partial_credit: float) -> dict[str, float]:
    """``exact`` (1 if ``got == want``), ``digits`` (the share of characters in the right
    place, over the longer of the two) and ``reward`` = exact + partial_credit x digits."""
    exact = float(got == want)
    digits = sum(a == b for a, b in zip(got, want)) / max(len(want), len(got), 1)
    return {"reward": exact + partial_credit * digits, "exact": exact, "digits": digits}
