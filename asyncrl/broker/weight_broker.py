"""WeightBroker: owns the policy version and every actor's version, plans who
receives what, and drives process-group transfers (learner rank 0 → vLLM workers).

    driver              WeightBroker (async Ray actor)              learner rank 0 / actors
    publish(V) ───────▶ wait for sync V-1 (bounded)
                        SnapshotOrder(V) ──── snapshot_weights ───▶ every rank: pack a copy
                          (direct: each sending learner rank packs its own engine shard)
               ◀─────── metrics of sync V-1 (and errors not returned before)
                        sync V in the background (sync_run.py): per sync set
                          SendOrder ──── send_weights ──────────▶ rank 0 (weights thread)
                          ReceiveOrder ── receive_weights ──────▶ each member actor
                          ◀── SendDone, Reloaded (each with a deadline)

Composed of a :class:`~asyncrl.broker.membership.Roster` (who, their versions, errors),
a :class:`~asyncrl.broker.sync_run.GroupCache` and a
:class:`~asyncrl.broker.sync_run.SyncRun` (one version's waves). One sync is in flight
at a time, so an actor never sees versions out of order. Actors leave
(``remove_actor``) and join (``add_actor``: a dead actor's replacement, primed from the
snapshot the last publish packed, never from the learner's live weights, which may have
moved on) while the run goes on (asyncrl/fault/actors.py).

Direct sends: when the learner is sharded without LoRA (rank 0's ``Attached.cuts``),
``broker.reshard`` is on, the group backend is gloo, every actor's engine runs the same
T > 1 workers, T is a multiple of ``learner.tp`` and the learner has enough ranks
(asyncrl/transport/reshard.py ``direct_senders``: a plain FSDP learner's ranks 0..T-1,
a TP learner's TP ranks of ``dp_rank`` 0 at ``learner.tp`` = T), each of those T learner
ranks packs and sends its own engine shard (``SnapshotOrder.tp`` and ``senders``,
``SendOrder.tp``); nothing is gathered on rank 0. Otherwise rank 0 gathers the model and
sends it (each worker its shard under ``broker.reshard``). Decided at start (``start()``
returns it as ``path``) and checked again at each snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from asyncrl.broker.base import BrokerError
from asyncrl.broker.membership import Roster
from asyncrl.broker.messages import CloseGroups, Listening, Snapshot, SnapshotOrder
from asyncrl.broker.settings import BrokerSettings
from asyncrl.broker.sync import SyncTally, combine_snapshots
from asyncrl.broker.sync_run import GroupCache, SyncRun
from asyncrl.transport.reshard import UnsupportedLayout, direct_senders
from asyncrl.transport.spec import NO_VERSION

log = logging.getLogger(__name__)

# Packing a snapshot is a local copy; this many timeouts is a generous bound.
SNAPSHOT_TIMEOUTS = 5


class WeightBroker:
    def __init__(
        self,
        actors: dict[str, Any],
        learner_ranks: list[Any],
        settings: BrokerSettings,
    ):
        self.s = settings
        self.ranks = list(learner_ranks)
        self.id = uuid.uuid4().hex[:8]
        self.version = 0
        self.roster = Roster(actors)
        # the learner ranks that send, rank 0 first; direct: the sender of engine shard t
        # at t (the list is shared with the group cache and the sync run)
        self.senders = list(self.ranks)
        self.groups = GroupCache(self.id, self.roster, self.senders, settings.max_groups)
        self.roster.on_drop = self.groups.forget_actor
        self.run = SyncRun(settings, self.roster, self.groups, self.senders)
        self.tp = 1  # > 1: the learner ranks in ``direct`` send engine shards 0..tp-1
        self.direct: tuple[int, ...] = ()  # their learner ranks, in engine rank order
        self.totals = {"broker/syncs": 0, "broker/bytes_sent": 0.0, "broker/sync_seconds": 0.0}
        self._sync: asyncio.Task | None = None
        self._last_snap: Snapshot | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> dict[str, Any]:
        """Attach to learner rank 0, learn every actor's versions, prime (version 0)."""
        import ray

        me = ray.get_runtime_context().current_actor
        attached = await self._bounded(
            self.ranks[0].attach_broker.remote(self.id, me, self.s),
            self.s.join_timeout_s,
            "attaching to learner rank 0",
        )
        self.run.host, self.run.backend = attached.host, attached.backend
        for name, a in list(self.roster.actors.items()):
            try:
                st = await self._bounded(
                    a.weight_state.remote(), self.s.join_timeout_s, f"actor {name!r} state"
                )
                self.roster.admit(name, a, st)
            except Exception as e:  # noqa: BLE001 - an actor that cannot answer is not synced
                self.roster.drop(name, f"unreachable at broker start: {e}")
        if not self.roster.views:
            raise BrokerError(f"no actor answered: {self.roster.dead}")
        path = await self._attach_tp(attached, me)
        if self.s.prime:
            snap = await self._snapshot(self.version)
            self._sync = asyncio.create_task(self._synced(self.version, snap, force=True))
            await self._wait()
            if self.roster.errors:
                raise BrokerError(f"the first weight sync (version 0) failed: {self.roster.errors}")
        return {
            "host": attached.host,
            "backend": attached.backend,
            "actors": sorted(self.roster.views),
            "path": path,
        }

    async def _attach_tp(self, attached: Any, me: Any) -> str:
        """Attach the learner ranks that send engine shards 1..T-1 when the learner's
        ranks can cut them (see the module's docstring); returns the path in words."""
        workers = sorted({v.workers for v in self.roster.views.values()})
        why = (
            "broker.reshard=false" if not self.s.reshard
            else "a LoRA or unsharded learner sends whole tensors" if not attached.cuts
            else f"backend {attached.backend}" if attached.backend != "gloo"
            else f"engine TP sizes {workers} differ" if len(workers) != 1
            else ""
        )  # fmt: skip
        if not why:
            try:
                senders = direct_senders(len(self.ranks), attached.tp, workers[0])
            except UnsupportedLayout as e:
                why = str(e)
        if why:
            return f"gather: learner rank 0 sends the model ({why})"
        await self._bounded(
            asyncio.gather(*[
                self.ranks[r].attach_broker.remote(self.id, me, self.s, t)
                for t, r in enumerate(senders) if t > 0
            ]),
            self.s.join_timeout_s,
            f"attaching to learner ranks {list(senders[1:])}",
        )  # fmt: skip
        self.tp, self.direct = len(senders), senders
        self.senders[:] = [self.ranks[r] for r in senders]
        return (
            f"direct: learner ranks {list(senders)} each send their own engine shard "
            f"(learner.tp={attached.tp}, engine TP size {len(senders)})"
        )

    async def close(self) -> None:
        try:
            await self._wait()
        finally:
            everything = CloseGroups(None)
            await asyncio.gather(
                *[self._quiet(r.detach_broker.remote()) for r in self.senders[: self.tp]],
                *[
                    self._quiet(self.roster.actors[n].close_weight_groups.remote(everything))
                    for n in self.roster.views
                ],
            )

    # ---- driver-facing --------------------------------------------------------------------
    async def publish(self, version: int) -> tuple[dict[str, float], list[str]]:
        """Finish the sync in flight, snapshot ``version`` from the learner and start
        syncing it in the background. Returns the finished sync's metrics and the errors
        not returned before."""
        if version <= self.version:
            raise BrokerError(
                f"publish({version}) after version {self.version}: versions must grow"
            )
        metrics = await self._wait()
        snap = await self._snapshot(version)
        self.version = version
        self._sync = asyncio.create_task(self._synced(version, snap))
        return metrics, self.roster.new_errors()

    async def wait(self) -> tuple[dict[str, float], list[str]]:
        """The sync in flight's metrics once done ({} if none), and new errors."""
        metrics = await self._wait()
        return metrics, self.roster.new_errors()

    def state(self) -> dict[str, Any]:
        views = self.roster.views
        return {
            "version": self.version,
            "actor_versions": {n: v.loaded for n, v in views.items()},
            "held_versions": {n: v.held for n, v in views.items()},
            "dead": dict(self.roster.dead),
            "errors": list(self.roster.errors),
            "totals": dict(self.totals),
        }

    def group_listening(self, msg: Listening) -> None:
        """Rank 0 hosts a new group: its members may be ordered to join."""
        group = self.groups.by_key(msg.key)
        if group is not None and group.listening is not None and not group.listening.done():
            group.listening.set_result(msg.port)

    # ---- actors leaving and joining (asyncrl/fault/actors.py) -----------------------------
    def supervise(self) -> None:
        self.roster.supervised = True

    def remove_actor(self, name: str, why: str) -> None:
        """Dropped from the sync set now (a sync in flight skips it)."""
        self.roster.remove(name, why)

    async def add_actor(self, name: str, handle: Any) -> None:
        """Register ``handle`` as ``name`` and bring it to the current version, in the
        background, behind the sync in flight (the next publish or wait waits for it
        and reports its errors)."""
        prev = self._sync
        self._sync = asyncio.create_task(self._join(prev, name, handle))

    async def _join(self, prev: asyncio.Task | None, name: str, handle: Any) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if prev is not None:
            try:
                metrics = await prev
            except Exception as e:  # noqa: BLE001 - the earlier sync's failure is its own
                self.roster.errors.append(f"weight sync before {name!r} joined: {e}")
        try:
            st = await self._bounded(
                handle.weight_state.remote(), self.s.join_timeout_s, f"actor {name!r} state"
            )
        except Exception as e:  # noqa: BLE001 - the new actor is dead too: not synced
            self.roster.errors.append(f"actor {name!r} could not join the sync set: {e}")
            return metrics
        self.roster.admit(name, handle, st)
        # The snapshot of self.version is still held on rank 0: a later one comes only
        # with the next publish, which first waits for this task.
        if self._last_snap is not None and st.version != self.version:
            primed = await self._synced(self.version, self._last_snap)
            metrics = {**primed, **metrics}  # the earlier sync's numbers win
        return metrics

    # ---- one sync ---------------------------------------------------------------------------
    async def _snapshot(self, version: int) -> Snapshot:
        views = self.roster.views.values()
        direct = self.s.reshard and self.tp > 1 and all(v.workers == self.tp for v in views)
        order = SnapshotOrder(
            self.id, version, tuple(sorted({v.held for v in views if v.held != NO_VERSION})),
            self.s.verify, tp=self.tp if direct else 0, senders=self.direct if direct else (),
        )  # fmt: skip
        snaps = await self._bounded(
            asyncio.gather(*[r.snapshot_weights.remote(order) for r in self.ranks]),
            SNAPSHOT_TIMEOUTS * self.s.timeout_s,
            f"snapshot of version {version} on the learner",
        )
        snap = combine_snapshots([snaps[r] for r in self.direct]) if direct else snaps[0]
        self._last_snap = snap
        self.run.n_buckets = snap.buckets
        return snap

    async def _synced(self, version: int, snap: Snapshot, force: bool = False) -> dict:
        acc = await self.run.run(version, snap, force)
        return self._finish(acc)

    async def _wait(self) -> dict[str, float]:
        if self._sync is None:
            return {}
        task, self._sync = self._sync, None
        backstop = self.run.backstop_s()
        try:
            metrics = await asyncio.wait_for(asyncio.shield(task), backstop)
        except TimeoutError:
            raise BrokerError(
                f"weight sync of version {self.version} still running after "
                f"{backstop:.0f}s (a deadline inside it failed to fire)"
            ) from None
        if not self.roster.views and not self.roster.supervised:
            raise BrokerError(f"every actor is dead: {self.roster.dead}")
        return metrics

    def _finish(self, acc: SyncTally) -> dict[str, float]:
        metrics = acc.metrics(time.monotonic() - acc.t0, len(self.roster.dead))
        self.totals["broker/syncs"] += 1
        for k in ("broker/bytes_sent", "broker/sync_seconds"):
            self.totals[k] += metrics[k]
        metrics.update(
            {f"broker/version/{n}": float(v.loaded) for n, v in self.roster.views.items()}
        )
        return metrics

    # ---- helpers --------------------------------------------------------------------------
    async def _bounded(self, aw: Any, timeout_s: float, what: str) -> Any:
        try:
            return await asyncio.wait_for(aw, timeout_s)
        except TimeoutError:
            raise BrokerError(f"{what} did not finish within {timeout_s:.0f}s") from None

    @staticmethod
    async def _quiet(aw: Any) -> None:
        try:
            await asyncio.wait_for(aw, 10.0)
        except Exception:  # noqa: BLE001 - best-effort cleanup
            pass
