"""WeightBroker: owns the policy version and every actor's version, plans who
receives what, and drives process-group transfers (learner rank 0 → vLLM workers).

    driver              WeightBroker (async Ray actor)              learner rank 0 / actors
    publish(V) ───────▶ wait for sync V-1 (bounded)
                        snapshot V ──────────── __ray_call__ ─────▶ pack a copy (shadows)
               ◀─────── metrics of sync V-1
                        sync V, in the background:
                          waves of sync sets (plan.py: rolling_k, grouped by held version)
                          per set: command {open group?, send} ◀── long poll: sender thread
                                   receive_weights(order) ──────────▶ each member actor
                                   await the sender's report (deadline)
                          per wave: await the members' reloads (deadline)
                          failure: error names actor, bucket, version; a dead actor is
                          dropped; live members of a failed set retry once, fresh group

Nothing here blocks on a peer without a deadline: every collective has
``timeout_s`` on both ends, and the broker bounds each step on top of that.
One sync is in flight at a time, so an actor never sees versions out of order.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from asyncrl.broker import learner_side
from asyncrl.broker.objectstore import BrokerError
from asyncrl.broker.plan import ActorView, SyncSet, plan_waves, ranks_of
from asyncrl.broker.settings import BrokerSettings
from asyncrl.transport.broadcast import NO_VERSION
from asyncrl.transport.group import HEADER_BUCKET

log = logging.getLogger(__name__)

# Slack on top of the transport's own deadlines before the broker gives up on a
# Ray call (process scheduling, RPC hops): the transport normally fails first.
SLACK_S = 30.0
# Packing a snapshot is a local copy; this many timeouts is a generous bound.
SNAPSHOT_TIMEOUTS = 5


@dataclass
class _Group:
    key: str
    ranks: dict[str, int]  # first rank of each member's workers
    world: int
    port: int = 0


@dataclass
class _Sync:
    """Accounting of one sync (one published version)."""

    version: int
    t0: float
    pack_seconds: float = 0.0
    bytes_sent: int = 0
    bytes_full: int = 0
    buckets_skipped: int = 0
    buckets_sparse: int = 0
    transfer_seconds: float = 0.0
    pause_max: float = 0.0
    sets: int = 0
    updated: int = 0
    errors: list[str] = field(default_factory=list)


class WeightBroker:
    def __init__(
        self,
        actors: dict[str, Any],
        learner_ranks: list[Any],
        settings: BrokerSettings,
        export: learner_side.Export | None = None,
    ):
        self.s = settings
        self.actors = dict(actors)
        self.ranks = list(learner_ranks)
        self.export = export
        self.id = uuid.uuid4().hex[:8]
        self.version = 0
        self.views: dict[str, ActorView] = {}
        self.dead: dict[str, str] = {}
        self.errors: list[str] = []  # every error so far, oldest first
        self.host = ""
        self.backend = ""
        self.totals = {"broker/syncs": 0, "broker/bytes_sent": 0.0, "broker/sync_seconds": 0.0}
        self._cmds: deque[dict[str, Any]] = deque()
        self._cmd_ready = asyncio.Event()
        self._waiters: dict[int, dict[str, asyncio.Future]] = {}
        self._groups: OrderedDict[tuple[str, ...], _Group] = OrderedDict()
        self._ids = itertools.count()
        self._sync: asyncio.Task | None = None
        self._n_buckets = 1

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> dict[str, Any]:
        """Attach to learner rank 0, learn every actor's versions, prime (version 0)."""
        import ray

        me = ray.get_runtime_context().current_actor
        settings = {k: getattr(self.s, k) for k in vars(self.s)}
        info = await self._bounded(
            self.ranks[0].__ray_call__.remote(learner_side.attach, self.id, me, settings),
            self.s.join_timeout_s,
            "attaching to learner rank 0",
        )
        self.host, self.backend = info["host"], info["backend"]
        for name, ref in [(n, a.weight_state.remote()) for n, a in self.actors.items()]:
            try:
                st = await self._bounded(ref, self.s.join_timeout_s, f"actor {name!r} state")
                self.views[name] = ActorView(st["version"], st["held"], st["workers"])
            except Exception as e:  # noqa: BLE001 - an actor that cannot answer is not synced
                self._drop(name, f"unreachable at broker start: {e}")
        if not self.views:
            raise BrokerError(f"no actor answered: {self.dead}")
        if self.s.prime:
            snap = await self._snapshot(self.version)
            self._sync = asyncio.create_task(self._run_sync(self.version, snap, force=True))
            await self.wait()
            if self.errors:
                raise BrokerError(f"the first weight sync (version 0) failed: {self.errors}")
        return {"host": self.host, "backend": self.backend, "actors": sorted(self.views)}

    async def close(self) -> None:
        try:
            await self.wait()
        finally:
            self._post({"op": "stop"})
            names = [n for n in self.views]
            await asyncio.gather(
                *[self._quiet(self.actors[n].close_weight_groups.remote(None)) for n in names]
            )

    # ---- driver-facing --------------------------------------------------------------------
    async def publish(self, version: int, nbytes: int = 0) -> dict[str, float]:
        """Finish the sync in flight (returns its metrics), snapshot ``version`` from
        the learner and start syncing it in the background."""
        if version <= self.version:
            raise BrokerError(
                f"publish({version}) after version {self.version}: versions must grow"
            )
        metrics = await self.wait()
        snap = await self._snapshot(version)
        self.version = version
        self._sync = asyncio.create_task(self._run_sync(version, snap))
        return metrics

    async def wait(self) -> dict[str, float]:
        """Metrics of the sync in flight once it is done ({} if none)."""
        if self._sync is None:
            return {}
        task, self._sync = self._sync, None
        try:
            metrics = await asyncio.wait_for(asyncio.shield(task), self._backstop_s())
        except TimeoutError:
            raise BrokerError(
                f"weight sync of version {self.version} still running after "
                f"{self._backstop_s():.0f}s (a deadline inside it failed to fire)"
            ) from None
        if not self.views:
            raise BrokerError(f"every actor is dead: {self.dead}")
        return metrics

    def state(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "actor_versions": {n: v.loaded for n, v in self.views.items()},
            "held_versions": {n: v.held for n, v in self.views.items()},
            "dead": dict(self.dead),
            "errors": list(self.errors),
            "totals": dict(self.totals),
        }

    def set_policy(self, mode: str | None = None, rolling_k: int | None = None) -> None:
        """Change the payload mode / rolling width for later syncs."""
        s = BrokerSettings(**{**vars(self.s)})
        s.mode = mode if mode is not None else s.mode
        s.rolling_k = rolling_k if rolling_k is not None else s.rolling_k
        s.check()
        self.s = s

    async def learner_digests(self) -> dict[str, str]:
        """Per-tensor digests of the learner's live weights, for bit-exactness checks."""
        refs = [
            r.__ray_call__.remote(learner_side.learner_digests, self.export) for r in self.ranks
        ]
        done = await self._bounded(asyncio.gather(*refs), 10 * self.s.timeout_s, "learner digests")
        return done[0]

    # ---- the learner-side command loop ------------------------------------------------------
    async def next_command(self, timeout_s: float) -> dict[str, Any] | None:
        """Long poll by the sender thread in learner rank 0 (single consumer)."""
        if not self._cmds:
            self._cmd_ready.clear()
            try:
                await asyncio.wait_for(self._cmd_ready.wait(), timeout_s)
            except TimeoutError:
                return None
        return self._cmds.popleft() if self._cmds else None

    def report(self, cid: int, kind: str, value: Any) -> None:
        fut = self._waiters.get(cid, {}).get(kind)
        if fut is not None and not fut.done():
            fut.set_result(value)

    def _post(self, cmd: dict[str, Any]) -> dict[str, asyncio.Future]:
        loop = asyncio.get_running_loop()
        futs: dict[str, asyncio.Future] = {}
        if "id" in cmd:
            futs = {"port": loop.create_future(), "done": loop.create_future()}
            self._waiters[cmd["id"]] = futs
        self._cmds.append(cmd)
        self._cmd_ready.set()
        return futs

    # ---- one sync ---------------------------------------------------------------------------
    async def _snapshot(self, version: int) -> dict[str, Any]:
        retain = sorted({v.held for v in self.views.values() if v.held != NO_VERSION})
        refs = [
            self.ranks[0].__ray_call__.remote(
                learner_side.snapshot, self.id, version, retain, self.s.verify, self.export
            )
        ] + [r.__ray_call__.remote(learner_side.drain, self.export) for r in self.ranks[1:]]
        snaps = await self._bounded(
            asyncio.gather(*refs),
            SNAPSHOT_TIMEOUTS * self.s.timeout_s,
            f"snapshot of version {version} on the learner",
        )
        self._n_buckets = snaps[0]["buckets"]
        return snaps[0]

    async def _run_sync(self, version: int, snap: dict[str, Any], force: bool = False) -> dict:
        acc = _Sync(version, time.monotonic(), pack_seconds=snap["pack_seconds"])
        waves = plan_waves(self.views, version, self.s.rolling_k, only_stale=not force)
        for wave in waves:
            retry = await self._run_wave(version, wave, snap, acc)
            live = {n: self.views[n] for n in retry if n in self.views}
            if live and self.s.retry:
                for again in plan_waves(live, version, 0):
                    await self._run_wave(version, again, snap, acc)
        return self._finish(acc)

    async def _run_wave(
        self, version: int, wave: list[SyncSet], snap: dict, acc: _Sync
    ) -> list[str]:
        """Transfer to each set in turn (one sender), then await every member's reload.
        Returns the live members that failed only because a peer did (retry them)."""
        launched = []
        for sset in wave:
            sset = SyncSet(tuple(m for m in sset.members if m in self.views), sset.base)
            if sset.members:
                launched.append(await self._transfer(version, sset, acc))
        retry: list[str] = []
        for sset, group, sender, refs in launched:
            retry += await self._settle(version, sset, group, sender, refs, snap, acc)
        return retry

    async def _transfer(self, version: int, sset: SyncSet, acc: _Sync):
        """Start one broadcast; returns once the sender is done (the members reload after)."""
        group, new = self._group_for(sset.members)
        cid = next(self._ids)
        futs = self._post(
            {"op": "send", "id": cid, "key": group.key, "version": version, "base": sset.base,
             "mode": self.s.mode, "world": group.world if new else None}
        )  # fmt: skip
        refs: dict[str, Any] = {}
        try:
            if new:
                await asyncio.wait(
                    set(futs.values()),
                    timeout=self.s.join_timeout_s + SLACK_S,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if not futs["port"].done():
                    sender = futs["done"].result() if futs["done"].done() else _no_report("open")
                    return sset, group, sender, refs
                group.port = futs["port"].result()
            order = self._order(version, group, sset)
            refs = {
                n: self.actors[n].receive_weights.remote({**order, "rank_offset": group.ranks[n]})
                for n in sset.members
            }
            try:
                sender = await asyncio.wait_for(futs["done"], self._transfer_deadline_s() + SLACK_S)
            except TimeoutError:
                sender = _no_report("send")
        finally:
            self._waiters.pop(cid, None)
        acc.sets += 1
        if sender["ok"]:
            acc.bytes_sent += sender["bytes_sent"]
            acc.bytes_full += sender["bytes_full"]
            acc.buckets_skipped += sender["buckets_skipped"]
            acc.buckets_sparse += sender["buckets_sparse"]
            acc.transfer_seconds += sender["seconds"]
        return sset, group, sender, refs

    async def _settle(self, version, sset, group, sender, refs, snap, acc) -> list[str]:
        """Judge each member of one set from its own result and the sender's report."""
        if not sender["ok"]:
            self._forget(sset.members, group)
        culprits = self._culprits(group, sender)
        retry = []
        deadline = self._transfer_deadline_s() + self.s.pause_timeout_s + 2 * self.s.timeout_s
        for name in sset.members:
            res = await self._actor_result(name, refs.get(name), deadline + SLACK_S)
            view = self.views[name]
            if res.get("ok"):
                view.loaded, view.held, view.failures = version, res["held"], 0
                acc.updated += 1
                acc.pause_max = max(acc.pause_max, res.get("pause_seconds", 0.0))
                bad = self._verify(name, res, snap)
                if bad:
                    self._error(acc, bad)
                continue
            view.held = res.get("held", NO_VERSION)
            where = _where(sender if name in culprits or not res.get("error") else res)
            why = [res.get("error")] + ([f"sender: {sender['error']}"] if not sender["ok"] else [])
            why_s = " | ".join(w for w in why if w) or "no result"
            msg = f"weight sync of version {version} to actor {name!r} failed at {where}: {why_s}"
            if res.get("dead") or not await self._alive(name):
                self._error(acc, msg)
                self._drop(name, msg)
            elif name in culprits or sender["ok"]:
                view.failures += 1
                self._error(acc, msg)
                if view.failures >= self.s.max_failures:
                    self._drop(name, f"{view.failures} failed syncs in a row; last: {msg}")
            else:
                retry.append(name)  # a peer broke the group under it
        return retry

    def _verify(self, name: str, res: dict, snap: dict) -> str | None:
        """With ``verify``: every worker loaded exactly the snapshot's bytes."""
        want = snap.get("digests")
        if not want:
            return None
        for w, got in enumerate(res.get("digests") or [None]):
            if got != want:
                got = got or {}
                diff = sorted(k for k in set(want) | set(got) if got.get(k) != want.get(k))
                return (
                    f"actor {name!r} worker {w} loaded version {snap['version']} "
                    f"with different bytes in {diff[:5]} ({len(diff)} tensors)"
                )
        return None

    async def _actor_result(self, name: str, ref: Any, timeout_s: float) -> dict[str, Any]:
        import ray

        if ref is None:
            return {"ok": False, "held": self.views[name].held, "error": ""}
        try:
            return await asyncio.wait_for(ref, timeout_s)
        except TimeoutError:
            return {"ok": False, "error": f"actor did not answer within {timeout_s:.0f}s"}
        except ray.exceptions.RayActorError as e:
            return {"ok": False, "dead": True, "error": f"actor process died: {e}"}

    async def _alive(self, name: str) -> bool:
        """Can the actor still serve (its process and its engine answer)?"""
        try:
            await asyncio.wait_for(self.actors[name].weight_state.remote(), self.s.timeout_s)
            return True
        except Exception:  # noqa: BLE001 - any failure to answer means it cannot serve
            return False

    def _culprits(self, group: _Group, sender: dict[str, Any]) -> set[str]:
        peers = set(sender.get("peer_ranks") or [])
        out = set()
        for name, first in group.ranks.items():
            if peers & set(range(first, first + self.views.get(name, ActorView(0)).workers)):
                out.add(name)
        return out

    def _finish(self, acc: _Sync) -> dict[str, float]:
        dt = time.monotonic() - acc.t0
        gbps = acc.bytes_sent / acc.transfer_seconds / 1e9 if acc.transfer_seconds else 0.0
        self.totals["broker/syncs"] += 1
        self.totals["broker/bytes_sent"] += acc.bytes_sent
        self.totals["broker/sync_seconds"] += dt
        return {
            "broker/sync_seconds": dt,
            "broker/bytes_sent": float(acc.bytes_sent),
            "broker/bytes_full": float(acc.bytes_full),
            "broker/buckets_skipped": float(acc.buckets_skipped),
            "broker/buckets_sparse": float(acc.buckets_sparse),
            "broker/transfer_seconds": acc.transfer_seconds,
            "broker/gbps": gbps,
            "broker/pack_seconds": acc.pack_seconds,
            "broker/pause_seconds_max": acc.pause_max,
            "broker/sets": float(acc.sets),
            "broker/actors_updated": float(acc.updated),
            "broker/errors": float(len(acc.errors)),
            "broker/dead": float(len(self.dead)),
            **{f"broker/version/{n}": float(v.loaded) for n, v in self.views.items()},
        }

    # ---- groups ---------------------------------------------------------------------------
    def _group_for(self, members: tuple[str, ...]) -> tuple[_Group, bool]:
        if members in self._groups:
            self._groups.move_to_end(members)
            return self._groups[members], False
        while len(self._groups) >= self.s.max_groups:
            old_members, old = self._groups.popitem(last=False)
            self._close_group(old_members, old)
        ranks, world = ranks_of(members, self.views)
        group = _Group(f"{self.id}-g{next(self._ids)}", ranks, world)
        self._groups[members] = group
        return group, True

    def _forget(self, members: tuple[str, ...], group: _Group) -> None:
        if self._groups.get(members) is group:
            del self._groups[members]
        self._close_group(members, group)

    def _close_group(self, members: tuple[str, ...], group: _Group) -> None:
        self._post({"op": "close", "keys": [group.key]})
        for n in members:
            if n in self.views:
                self.actors[n].close_weight_groups.remote([group.key])  # best effort

    def _order(self, version: int, group: _Group, sset: SyncSet) -> dict[str, Any]:
        return {
            "key": group.key,
            "host": self.host,
            "port": group.port,
            "world_size": group.world,
            "version": version,
            "backend": self.backend,
            "hold_copy": self.s.hold_copy,
            "timeout_s": self.s.timeout_s,
            "join_timeout_s": self.s.join_timeout_s,
            "deadline_s": self._transfer_deadline_s(),
            "pause_timeout_s": self.s.pause_timeout_s,
            "apply_timeout_s": max(self.s.timeout_s, 60.0),
            "with_digests": self.s.verify,
        }

    # ---- helpers --------------------------------------------------------------------------
    def _transfer_deadline_s(self) -> float:
        """Upper bound of one set's transfer: join, then every bucket's collective."""
        return self.s.join_timeout_s + (self._n_buckets + 4) * self.s.timeout_s

    def _backstop_s(self) -> float:
        per_set = self._transfer_deadline_s() + self.s.pause_timeout_s + 3 * self.s.timeout_s
        return 2 * (len(self.views) + 1) * (per_set + SLACK_S)

    def _error(self, acc: _Sync, msg: str) -> None:
        log.error("%s", msg)
        acc.errors.append(msg)
        self.errors.append(msg)

    def _drop(self, name: str, why: str) -> None:
        log.error("actor %s dropped from the sync set: %s", name, why)
        self.dead[name] = why
        self.views.pop(name, None)
        for members, group in list(self._groups.items()):
            if name in members:
                self._forget(members, group)

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


def _no_report(stage: str) -> dict[str, Any]:
    return {
        "ok": False,
        "error": f"learner rank 0 did not report the {stage} in time (dead or stuck)",
        "peer_ranks": [0],
        "bucket": HEADER_BUCKET,
    }


def _where(res: dict[str, Any]) -> str:
    bucket = res.get("bucket")
    if bucket is None:
        return "setup"
    return "header" if bucket == HEADER_BUCKET else f"bucket {bucket}"
