"""``eval.*``: the evaluation actor's settings, checked before Ray starts.

Pure Python (no torch, vLLM or Ray), like the other settings modules; conf/eval/
default.yaml holds every value. A set's own keys (``eval.sets.<name>.*``) take
:class:`EvalSetSettings`' defaults: a user names new sets, so no YAML can list them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncrl.config import TIMEOUT_S, ConfigError, Settings, parse_range, setting, settings_from


@dataclass
class EvalSetSettings(Settings):
    """One held-out prompt set: ``eval.sets.<name>``."""

    KEY = "eval.sets.heldout"

    # a task config (``_target_`` + its arguments); null: the training task
    task: dict[str, Any] | None = None
    # draws the set's prompts (from the held-out split only)
    seed: int = field(default=1, metadata={"range": parse_range(">= 0")})


@dataclass
class EvalSettings(Settings):
    KEY = "eval"

    every: int = setting(">= 0")  # evaluate every N policy versions; 0: no evaluation actor
    k: int = setting(">= 1")  # samples per prompt for pass@k (temperature ``temperature``)
    num_prompts: int = setting(">= 1")  # prompts per set
    temperature: float = setting("> 0")  # of the pass@k samples (pass@1 is greedy)
    max_tokens: int | None = setting(">= 1")  # null: actor.sampling.max_tokens
    pass_reward: float = setting()  # a sample passes when the task's reward reaches this
    # Share of the problem space held out of training: a prompt whose text hashes below
    # it is never drawn for training while evaluation is on (eval/split.py).
    heldout_frac: float = setting("(0, 1)")
    num_cpus: float = setting(">= 0")  # Ray CPUs reserved (0: it shares the cores)
    timeout_s: float = setting(TIMEOUT_S)  # an evaluation running at the end is waited this long
    # episode groups at once of an env that takes turns (each episode's env.timeout_s
    # counts from its own start, not from when the whole set was queued)
    max_inflight_groups: int = setting(">= 1")
    # name -> EvalSetSettings (a mapping in config: each entry checked in ``check``)
    sets: dict[str, Any] = setting()

    @property
    def enabled(self) -> bool:
        return self.every > 0

    def check(self) -> None:
        super().check()
        if self.enabled and not self.sets:
            raise ConfigError("eval.sets is empty: name at least one set (e.g. heldout: {})")
        for name, node in list(self.sets.items()):
            if not name or "/" in str(name):
                raise ConfigError(f"eval.sets.{name!r}: a set's name must be non-empty, no '/'")
            if not isinstance(node, EvalSetSettings):
                self.sets[name] = settings_from(EvalSetSettings, node or {}, f"eval.sets.{name}")
