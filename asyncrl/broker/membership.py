"""Actors leaving and joining a running process-group broker (a dead actor, its
restarted replacement: asyncrl/fault/actors.py).

    driver: remove_actor(name)  ─▶ dropped from the sync set now (a sync in flight
                                   skips it), no later plan includes it
    driver: add_actor(name, h)  ─▶ queued behind the sync in flight: then the actor's
                                   versions are read and the CURRENT version is synced
                                   to it from the snapshot the last publish packed

The prime never asks the learner for weights: the learner may be training the next
step by then, and its live weights would no longer be the version they are labelled.
The snapshot of ``self.version`` is still held on learner rank 0 (a later snapshot
comes only with the next publish, which first waits for this prime).
"""

from __future__ import annotations

import asyncio
from typing import Any

from asyncrl.broker.plan import ActorView


class Membership:
    """Mixed into :class:`~asyncrl.broker.weight_broker.WeightBroker` (its state and
    helpers: ``actors``, ``views``, ``dead``, ``_sync``, ``_drop``, ``_run_sync``)."""

    # With a supervisor (fault.actor_restarts > 0) an empty sync set is not the end of
    # the run: a replacement may be starting. The supervisor decides when it is over.
    supervised = False
    _last_snap: dict[str, Any] | None = None

    def supervise(self) -> None:
        self.supervised = True

    def remove_actor(self, name: str, why: str) -> None:
        self._drop(name, why)
        self.actors.pop(name, None)

    async def add_actor(self, name: str, handle: Any) -> None:
        """Register ``handle`` as ``name`` and bring it to the current version, in the
        background (the next publish or wait waits for it and reports its errors)."""
        prev = self._sync
        self._sync = asyncio.create_task(self._join(prev, name, handle))

    async def _join(self, prev: asyncio.Task | None, name: str, handle: Any) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if prev is not None:
            try:
                metrics = await prev
            except Exception as e:  # noqa: BLE001 - the earlier sync's failure is its own
                self.errors.append(f"weight sync before {name!r} joined: {e}")
        try:
            st = await self._bounded(
                handle.weight_state.remote(), self.s.join_timeout_s, f"actor {name!r} state"
            )
        except Exception as e:  # noqa: BLE001 - the new actor is dead too: not synced
            self.errors.append(f"actor {name!r} could not join the sync set: {e}")
            return metrics
        self.actors[name] = handle
        self.dead.pop(name, None)
        self.views[name] = ActorView(st["version"], st["held"], st["workers"])
        if self._last_snap is not None and st["version"] != self.version:
            primed = await self._run_sync(self.version, self._last_snap)
            metrics = {**primed, **metrics}  # the earlier sync's numbers win
        return metrics
