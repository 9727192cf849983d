"""``eval.*``: the evaluation actor's settings, checked before Ray starts.

Pure Python (no torch, vLLM or Ray), like the other settings modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncrl.config import ConfigError, settings_from


@dataclass
class EvalSetSettings:
    """One held-out prompt set: ``eval.sets.<name>``."""

    # a task config (``_target_`` + its arguments); null: the training task
    task: dict[str, Any] | None = None
    seed: int = 1  # draws the set's prompts (from the held-out split only)


@dataclass
class EvalSettings:
    every: int = 0  # evaluate every N policy versions; 0: no evaluation actor at all
    k: int = 4  # samples per prompt for pass@k (temperature ``temperature``)
    num_prompts: int = 32  # prompts per set
    temperature: float = 1.0  # of the pass@k samples (pass@1 is greedy)
    max_tokens: int | None = None  # null: actor.sampling.max_tokens
    pass_reward: float = 1.0  # a sample passes when the task's reward reaches this
    # Share of the problem space held out of training: a prompt whose text hashes below
    # it is never drawn for training while evaluation is on (eval/split.py).
    heldout_frac: float = 0.1
    num_cpus: float = 0.0  # Ray CPUs reserved (0: it shares the cores; a 2-core box has none spare)
    timeout_s: float = 300.0  # an evaluation still running at the end is waited for this long
    # name -> EvalSetSettings (a mapping in config: each entry checked in ``check``)
    sets: dict[str, Any] = field(default_factory=lambda: {"heldout": EvalSetSettings()})

    @property
    def enabled(self) -> bool:
        return self.every > 0

    @classmethod
    def from_config(cls, node: Any) -> EvalSettings:
        return settings_from(cls, node if node is not None else {}, "eval")

    def check(self) -> None:
        if self.every < 0:
            raise ConfigError(f"eval.every={self.every}: must be >= 0 (0: no evaluation)")
        if self.k < 1:
            raise ConfigError(f"eval.k={self.k}: must be >= 1")
        if self.num_prompts < 1:
            raise ConfigError(f"eval.num_prompts={self.num_prompts}: must be >= 1")
        if self.temperature <= 0:
            raise ConfigError(
                f"eval.temperature={self.temperature}: must be > 0 (pass@1 is already greedy)"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError(f"eval.max_tokens={self.max_tokens}: must be >= 1 or null")
        if not 0 < self.heldout_frac < 1:
            raise ConfigError(f"eval.heldout_frac={self.heldout_frac}: must be in (0, 1)")
        if self.num_cpus < 0:
            raise ConfigError(f"eval.num_cpus={self.num_cpus}: must be >= 0")
        if self.timeout_s <= 0:
            raise ConfigError(f"eval.timeout_s={self.timeout_s}: must be > 0")
        if self.enabled and not self.sets:
            raise ConfigError("eval.sets is empty: name at least one set (e.g. heldout: {})")
        for name, node in list(self.sets.items()):
            if not name or "/" in str(name):
                raise ConfigError(f"eval.sets.{name!r}: a set's name must be non-empty, no '/'")
            if not isinstance(node, EvalSetSettings):
                self.sets[name] = settings_from(EvalSetSettings, node or {}, f"eval.sets.{name}")
