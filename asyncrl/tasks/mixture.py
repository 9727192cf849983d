"""A weighted mixture of tasks: each prompt comes from one of them, drawn by weight,
and is scored by the task that made it.

    task:
      _target_: asyncrl.tasks.mixture.MixtureTask
      tasks:
        small: {weight: 0.5, task: {_target_: asyncrl.tasks.arithmetic.AdditionTask, max_operand: 9}}
        large: {weight: 0.5, task: {_target_: ..., max_operand: 49}}

Every reward carries ``task/<name>`` (the reward again, under its task's name): the
learner averages such a key over the trajectories that carry it, so
``reward/task/<name>`` is each task's own mean reward in a step (learner/metrics.py).
The sub-tasks' breakdown keys pass through unchanged.
"""

from __future__ import annotations

import bisect
import json
import random
from pathlib import Path
from typing import Any

from asyncrl.tasks.base import Prompt, Task

TASK_KEY = "task"  # Prompt.meta key: the name of the task that made the prompt


class MixtureTask:
    def __init__(self, tasks: dict[str, dict[str, Any]]):
        if not tasks:
            raise ValueError("task.tasks is empty: list at least one {weight, task}")
        self.tasks: dict[str, Task] = {}
        weights = []
        for name, entry in tasks.items():
            if not isinstance(entry, dict) or set(entry) != {"weight", "task"}:
                raise ValueError(
                    f"task.tasks.{name}: expected exactly {{weight: W, task: {{_target_: ...}}}}, "
                    f"got {entry!r}"
                )
            w, t = entry["weight"], entry["task"]
            if not isinstance(w, int | float) or w <= 0:
                raise ValueError(f"task.tasks.{name}.weight={w!r}: must be a number > 0")
            if not (hasattr(t, "sample") and hasattr(t, "reward")):
                raise ValueError(f"task.tasks.{name}.task is not a task (sample, reward): {t!r}")
            if "/" in name:
                raise ValueError(f"task.tasks.{name!r}: a task's name may not contain '/'")
            self.tasks[name] = t
            weights.append(float(w))
        self.names = list(self.tasks)
        total = sum(weights)
        self.weights = [w / total for w in weights]
        self._cum = [sum(self.weights[: i + 1]) for i in range(len(weights))]
        # a scalar attribute naming the mixture: the tiny model's cache key reads the
        # task's scalar attributes, and two mixtures must not share a warm-started model
        self.spec = json.dumps(
            [[n, w, type(t).__qualname__, _scalars(t)] for n, w, t in
             zip(self.names, self.weights, self.tasks.values())], sort_keys=True
        )  # fmt: skip

    def pick(self, rng: random.Random) -> str:
        i = bisect.bisect_left(self._cum, rng.random())
        return self.names[min(i, len(self.names) - 1)]

    def sample(self, rng: random.Random) -> Prompt:
        name = self.pick(rng)
        p = self.tasks[name].sample(rng)
        p.meta = {**p.meta, TASK_KEY: name}
        return p

    def reward(self, prompt: Prompt, completion: str) -> dict[str, float]:
        name = prompt.meta[TASK_KEY]
        out = self.tasks[name].reward(prompt, completion)
        d = (
            {k: float(v) for k, v in out.items()}
            if isinstance(out, dict)
            else {"reward": float(out)}
        )
        d[f"{TASK_KEY}/{name}"] = d["reward"]
        return d

    # ---- what the tiny model and chat forms ask of a task ------------------------------
    @property
    def alphabet(self) -> str:
        chars = "".join(getattr(t, "alphabet", "") for t in self.tasks.values())
        return "".join(dict.fromkeys(chars))  # the union, first-seen order

    @property
    def max_response_chars(self) -> int:
        return max(getattr(t, "max_response_chars", 0) for t in self.tasks.values())

    def bind_model(self, model_path: str | Path) -> None:
        for t in self.tasks.values():
            if hasattr(t, "bind_model"):
                t.bind_model(model_path)


def _scalars(task: Any) -> dict[str, Any]:
    return {k: v for k, v in sorted(vars(task).items()) if isinstance(v, int | float | str | bool)}
