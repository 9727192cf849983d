"""``fault.*``: how a run survives a dead part, checked before Ray starts.

Pure Python (no torch, vLLM or Ray), like the other settings modules; conf/fault/
default.yaml holds every value.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.config import TIMEOUT_S, Settings, setting


@dataclass
class FaultSettings(Settings):
    KEY = "fault"

    # Restarts of one rollout actor (its process or its vLLM engine died) before it
    # stays dead; 0: a dead actor is never restarted (the run goes on with the others,
    # and stops with one line when none is left).
    actor_restarts: int = setting(">= 0")
    # A restarted actor must be up (engine started, weights of the current version
    # loaded) within this long, or the attempt counts as failed.
    actor_start_timeout_s: float = setting(TIMEOUT_S)
    # Restarts of the whole run from its newest complete checkpoint after a learner
    # rank died (0: a dead learner ends the run with one line, exit 3).
    max_restarts: int = setting(">= 0")
