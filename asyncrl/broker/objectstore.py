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

    def publish(self, version: int) -> dict[str, float]:
        import ray

        metrics = self.wait()
        got = ray.get([r.weights_ref.remote() for r in self.ranks], timeout=self.timeout_s)
        weights = got[0]  # rank 0's; the other ranks only took part in the unshard
        self.version = version
        self._pending_version = version
        self._t_publish = time.time()
        self._bytes = int(weights["bytes"])
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
        if not self.actors:
            raise BrokerError(f"every actor is dead: {self.dead}")
        return {
            "broker/sync_seconds": dt,
            "broker/weights_bytes": float(self._bytes),
            "broker/bytes_sent": sent,
            "broker/bytes_full": float(self._bytes * len(names)),
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

    def _drop(self, name: str, why: str) -> None:
        msg = f"actor {name} dropped from the sync set: {why}"
        log.error("%s", msg)
        self.errors.append(msg)
        self.dead[name] = why
        self.actors.pop(name, None)
        self.actor_versions.pop(name, None)
