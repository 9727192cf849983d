"""Prompt samplers: uniform (the task's own stream) or difficulty-adaptive.

    actor: prompt = sampler.next()  ─▶ group generated and scored
           sampler.observe(prompt, rewards)  ─▶ the prompt's recent groups

A group whose rewards are all equal (all 0 or all 1 on a verifier) carries no GRPO
signal: every advantage is 0 (``reward/zero_variance_frac`` counts them). The adaptive
sampler remembers, per prompt text, whether its last ``window`` groups were such; a
draw that lands on a prompt whose every remembered group was zero-variance is redrawn
with probability ``skip_prob`` (down-weighted, not banned: a prompt the policy solves
today may fail tomorrow, and one it never solves may become reachable), at most
``max_redraws`` times. Every random choice comes from the sampler's own seeded rng,
and ``state_dict`` holds that rng and the memory: a resumed run (the checkpoint's
``driver_state.json``) draws on exactly as if it had never stopped.

Chosen by ``sampler=uniform|adaptive`` (conf/sampler/, :class:`SamplerSettings`); the
driver wraps the task in :class:`Sampled` so that each actor builds its sampler with
:func:`make_sampler`.
"""

from __future__ import annotations

import enum
import random
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any

from asyncrl.config import Settings, setting
from asyncrl.tasks.base import Prompt, Task, TaskSampler


class SamplerKind(enum.StrEnum):
    UNIFORM = "uniform"
    ADAPTIVE = "adaptive"


@dataclass
class SamplerSettings(Settings):
    """``sampler``: conf/sampler/uniform.yaml holds every value."""

    KEY = "sampler"

    kind: SamplerKind = setting()
    window: int = setting(">= 1")  # groups remembered per prompt
    skip_prob: float = setting("[0, 1]")  # chance a draw of an all-zero-variance prompt is redrawn
    max_redraws: int = setting(">= 0")  # redraws per slot at most (then the last draw is taken)
    # prompts remembered at most (least recently seen forgotten first): bounds the
    # memory and the checkpoint on a task with an unbounded prompt space
    max_prompts: int = setting(">= 1")


class UniformSampler(TaskSampler):
    """The task's own stream; what it observes changes nothing."""

    def observe(self, prompt: Prompt, rewards: list[float]) -> None:
        pass


class AdaptiveSampler(TaskSampler):
    def __init__(self, task: Task, seed: int = 0, settings: SamplerSettings | None = None):
        super().__init__(task, seed)
        self.settings = settings or SamplerSettings.defaults(kind=SamplerKind.ADAPTIVE)
        # prompt text -> its last `window` groups, 1 = zero variance (oldest first)
        self.recent: OrderedDict[str, list[int]] = OrderedDict()
        self.skipped = 0  # draws redrawn so far

    def next(self) -> Prompt:
        s = self.settings
        for _ in range(s.max_redraws):
            p = super().next()
            if not self._uninformative(p.text) or self._rng.random() >= s.skip_prob:
                return p
            self.skipped += 1
        return super().next()

    def _uninformative(self, text: str) -> bool:
        seen = self.recent.get(text)
        return bool(seen) and all(seen)

    def observe(self, prompt: Prompt, rewards: list[float]) -> None:
        """One finished group of ``prompt``: whether its rewards all agree."""
        if not rewards:
            return
        flat = int(max(rewards) == min(rewards))
        seen = self.recent.pop(prompt.text, [])
        self.recent[prompt.text] = (seen + [flat])[-self.settings.window :]
        while len(self.recent) > self.settings.max_prompts:
            self.recent.popitem(last=False)

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "adaptive": {
                "recent": [[k, v] for k, v in self.recent.items()],  # JSON keeps the order
                "skipped": self.skipped,
                "settings": {
                    k: str(v) if isinstance(v, enum.Enum) else v
                    for k, v in asdict(self.settings).items()
                },  # fmt: skip
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        a = state.get("adaptive")
        if a is None:  # a checkpoint of a uniform run: the memory starts empty
            self.recent, self.skipped = OrderedDict(), 0
            return
        self.recent = OrderedDict((k, list(v)) for k, v in a["recent"])
        self.skipped = int(a["skipped"])


class Sampled:
    """A task together with how its prompts are drawn (the driver's wrapper: what
    reaches each actor). Forwards everything else to the task."""

    def __init__(self, task: Task, settings: SamplerSettings):
        self.inner = task
        self.sampler_settings = settings

    def sample(self, rng: random.Random) -> Prompt:
        return self.inner.sample(rng)

    def reward(self, prompt: Prompt, completion: str) -> Any:
        return self.inner.reward(prompt, completion)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "inner":  # pickling: no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def with_sampler(task: Task, settings: SamplerSettings) -> Task:
    """``task`` as the actors take it: itself for the uniform sampler."""
    return task if settings.kind is SamplerKind.UNIFORM else Sampled(task, settings)


def make_sampler(task: Task, seed: int) -> UniformSampler | AdaptiveSampler:
    """The actor's prompt stream for ``task`` (as :func:`with_sampler` returned it)."""
    if isinstance(task, Sampled):
        return AdaptiveSampler(task.inner, seed, task.sampler_settings)
    return UniformSampler(task, seed)
