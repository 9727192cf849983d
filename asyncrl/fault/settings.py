"""``fault.*``: how a run survives a dead part, checked before Ray starts.

Pure Python (no torch, vLLM or Ray), like the other settings modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncrl.config import ConfigError, settings_from


@dataclass
class FaultSettings:
    # Restarts of one rollout actor (its process or its vLLM engine died) before it
    # stays dead; 0: a dead actor is never restarted (the run goes on with the others,
    # and stops with one line when none is left).
    actor_restarts: int = 3
    # A restarted actor must be up (engine started, weights of the current version
    # loaded) within this long, or the attempt counts as failed.
    actor_start_timeout_s: float = 300.0
    # Restarts of the whole run from its newest complete checkpoint after a learner
    # rank died (0: a dead learner ends the run with one line, exit 3).
    max_restarts: int = 1

    @classmethod
    def from_config(cls, node: Any) -> FaultSettings:
        return settings_from(cls, node if node is not None else {}, "fault")

    def check(self) -> None:
        if self.actor_restarts < 0:
            raise ConfigError(f"fault.actor_restarts={self.actor_restarts}: must be >= 0")
        if self.actor_start_timeout_s <= 0:
            raise ConfigError(
                f"fault.actor_start_timeout_s={self.actor_start_timeout_s}: must be > 0"
            )
        if self.max_restarts < 0:
            raise ConfigError(f"fault.max_restarts={self.max_restarts}: must be >= 0")
