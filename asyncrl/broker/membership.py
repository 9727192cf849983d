"""Who the process-group broker syncs: every live actor's view, the dead ones and why,
and every error so far (a :class:`Roster`, held by the WeightBroker).

    start / add_actor ─▶ admit(name, handle, WeightState)
    a failed sync     ─▶ error(msg); drop(name, why): out of every later plan, its
                         cached groups closed (``on_drop``)
    remove_actor      ─▶ remove(name, why): dropped and its handle forgotten
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from asyncrl.broker.messages import WeightState
from asyncrl.broker.plan import ActorView

log = logging.getLogger(__name__)


class Roster:
    """The actors a broker knows (``actors``: name -> Ray handle) and their versions."""

    def __init__(self, actors: dict[str, Any]):
        self.actors = dict(actors)
        self.views: dict[str, ActorView] = {}
        self.dead: dict[str, str] = {}
        self.errors: list[str] = []  # every error so far, oldest first
        self._returned = 0  # errors[:this] went back to the driver already
        # With a supervisor (fault.actor_restarts > 0) an empty sync set is not the end
        # of the run: a replacement may be starting. The supervisor decides when.
        self.supervised = False
        self.on_drop: Callable[[str], None] = lambda name: None

    def admit(self, name: str, handle: Any, st: WeightState) -> None:
        self.actors[name] = handle
        self.dead.pop(name, None)
        self.views[name] = ActorView(st.version, st.held, st.workers, update_mode=st.update_mode)

    def error(self, msg: str) -> None:
        log.error("%s", msg)
        self.errors.append(msg)

    def new_errors(self) -> list[str]:
        """The errors not returned before."""
        new = self.errors[self._returned :]
        self._returned = len(self.errors)
        return new

    def drop(self, name: str, why: str) -> None:
        log.error("actor %s dropped from the sync set: %s", name, why)
        self.dead[name] = why
        self.views.pop(name, None)
        self.on_drop(name)

    def remove(self, name: str, why: str) -> None:
        self.drop(name, why)
        self.actors.pop(name, None)
