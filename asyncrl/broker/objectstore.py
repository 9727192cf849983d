"""The object-store broker: learner rank 0 ``ray.put``s its weights once, every actor
maps them from the object store and reloads them in place.

    publish(V) ─▶ wait for the previous sync (bounded) ─▶ learner ranks: weights_ref()
               ─▶ actor.update_weights([ref], V) × N   (not awaited: generation and the
                  next learner step overlap it)

At most one sync is in flight: a new publish first collects the last one, so an actor
never receives versions out of order. A dead actor is dropped from the sync set with a
message naming it; a sync that outlives ``timeout_s`` raises naming the actor and the
version.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from asyncrl.broker.base import BrokerError

log = logging.getLogger(__name__)


class ObjectStoreBroker:
    def __init__(self, actors: dict[str, Any], learner_ranks: list[Any], timeout_s: float = 120.0):
        self.actors = dict(actors)
        self.ranks = list(learner_ranks)
        self.timeout_s = timeout_s
        self.actor_versions = {name: 0 for name in actors}
        self.version = 0
        self.dead: dict[str, str] = {}
        self.errors: list[str] = []
        self._pending: dict[str, Any] = {}
        self._pending_version = 0
        self._t_publish = 0.0
        self._bytes = 0
        self.totals = {"broker/syncs": 0, "broker/bytes_sent": 0.0, "broker/sync_seconds": 0.0}
        # The last published weights (kept referenced: a restarted actor is primed with
        # them while the learner may already train the next step) and whether a
        # supervisor restarts dead actors (then no actor left is not the end of the run).
        self._last_refs: list | None = None
        self.supervised = False

    def publish(self, version: int) -> dict[str, float]:
        import ray

        metrics = self.wait()
        got = ray.get([r.weights_ref.remote() for r in self.ranks], timeout=self.timeout_s)
        weights = got[0]  # rank 0's; the other ranks only took part in the unshard
        self.version = version
        self._pending_version = version
        self._t_publish = time.time()
        self._bytes = int(weights["bytes"])
        self._last_refs = weights["refs"]
        self._pending = {
            n: a.update_weights.remote(weights["refs"], version) for n, a in self.actors.items()
        }
        return metrics

    def wait(self) -> dict[str, float]:
        """Collect the sync in flight; returns its metrics (empty if none)."""
        import ray

        if not self._pending:
            return {}
        names = list(self._pending)
        refs = [self._pending[n] for n in names]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        done = set(ready)
        for name, ref in zip(names, refs):
            if ref not in done:
                raise BrokerError(
                    f"weight sync of version {self._pending_version} to actor {name!r} did not "
                    f"finish within broker.timeout_s={self.timeout_s}s"
                )
            try:
                ray.get(ref)
                self.actor_versions[name] = self._pending_version
            except ray.exceptions.RayActorError as e:
                self._drop(name, f"died during the sync of version {self._pending_version}: {e}")
        self._pending = {}
        dt = time.time() - self._t_publish
        n_ok = sum(
            self.actor_versions[n] == self._pending_version for n in names if n in self.actors
        )
        sent = float(self._bytes * n_ok)
        self.totals["broker/syncs"] += 1
        self.totals["broker/bytes_sent"] += sent
        self.totals["broker/sync_seconds"] += dt
        if not self.actors and not self.supervised:
            raise BrokerError(f"every actor is dead: {self.dead}")
        return {
            "broker/sync_seconds": dt,
            "broker/weights_bytes": float(self._bytes),
            "broker/bytes_sent": sent,
            "broker/bytes_full": float(self._bytes * len(names)),
            # every worker reloads the whole file (vLLM's loaders slice it): never resharded
            "broker/bytes_per_engine_rank": float(self._bytes),
            "broker/gbps": sent / dt / 1e9 if dt > 0 else 0.0,
            "broker/errors": float(len(names) - n_ok),
            **{f"broker/version/{n}": float(v) for n, v in self.actor_versions.items()},
        }

    def state(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "actor_versions": dict(self.actor_versions),
            "dead": dict(self.dead),
            "errors": list(self.errors),
            "totals": dict(self.totals),
        }

    def close(self) -> None:
        self.wait()

    # ---- actors leaving and joining (asyncrl/fault/actors.py) -------------------------
    def supervise(self) -> None:
        self.supervised = True

    def remove_actor(self, name: str, why: str) -> None:
        if name in self.actors:
            self._drop(name, why)
        self._pending.pop(name, None)

    def add_actor(self, name: str, handle: Any) -> None:
        """Register ``handle`` as ``name``; it gets the current version with the sync
        in flight (collected by the next ``wait``), or now if none is."""
        self.actors[name] = handle
        self.dead.pop(name, None)
        self.actor_versions[name] = 0  # a fresh engine holds the initial weights
        if self._last_refs is None or self.version == 0:
            return
        if not self._pending:
            self._pending_version, self._t_publish = self.version, time.time()
        self._pending[name] = handle.update_weights.remote(self._last_refs, self.version)

    def _drop(self, name: str, why: str) -> None:
        msg = f"actor {name} dropped from the sync set: {why}"
        log.error("%s", msg)
        self.errors.append(msg)
        self.dead[name] = why
        self.actors.pop(name, None)
        self.actor_versions.pop(name, None)
