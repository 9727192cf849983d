"""WeightBroker: owns the policy version and every actor's version, plans who
receives what, and drives process-group transfers (learner rank 0 → vLLM workers).

    driver              WeightBroker (async Ray actor)              learner rank 0 / actors
    publish(V) ───────▶ wait for sync V-1 (bounded)
                        snapshot V ───────── snapshot_weights ────▶ pack a copy (shadows)
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
from collections import OrderedDict
from typing import Any

from asyncrl.broker.base import BrokerError
from asyncrl.broker.learner_side import CommandQueue
from asyncrl.broker.membership import Membership
from asyncrl.broker.plan import ActorView, SyncSet, plan_waves, ranks_of
from asyncrl.broker.settings import BrokerSettings
from asyncrl.broker.sync import Group, SyncTally, culprits, digest_mismatch, no_report, where
from asyncrl.transport.broadcast import NO_VERSION

log = logging.getLogger(__name__)

# Slack on top of the transport's own deadlines before the broker gives up on a
# Ray call (process scheduling, RPC hops): the transport normally fails first.
SLACK_S = 30.0
# Packing a snapshot is a local copy; this many timeouts is a generous bound.
SNAPSHOT_TIMEOUTS = 5


class WeightBroker(Membership):  # remove_actor / add_actor: membership.py
    def __init__(
        self,
        actors: dict[str, Any],
        learner_ranks: list[Any],
        settings: BrokerSettings,
    ):
        self.s = settings
        self.actors = dict(actors)
        self.ranks = list(learner_ranks)
        self.id = uuid.uuid4().hex[:8]
        self.version = 0
        self.views: dict[str, ActorView] = {}
        self.dead: dict[str, str] = {}
        self.errors: list[str] = []  # every error so far, oldest first
        self._errors_returned = 0  # errors[:this] went back to the driver already
        self.host = ""
        self.backend = ""
        self.totals = {"broker/syncs": 0, "broker/bytes_sent": 0.0, "broker/sync_seconds": 0.0}
        self.commands = CommandQueue()
        self._groups: OrderedDict[tuple[str, ...], Group] = OrderedDict()
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
            self.ranks[0].attach_broker.remote(self.id, me, settings),
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
            await self._wait()
            if self.errors:
                raise BrokerError(f"the first weight sync (version 0) failed: {self.errors}")
        return {"host": self.host, "backend": self.backend, "actors": sorted(self.views)}

    async def close(self) -> None:
        try:
            await self._wait()
        finally:
            self.commands.post({"op": "stop"})
            names = [n for n in self.views]
            await asyncio.gather(
                self._quiet(self.ranks[0].detach_broker.remote()),
                *[self._quiet(self.actors[n].close_weight_groups.remote(None)) for n in names],
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
        self._sync = asyncio.create_task(self._run_sync(version, snap))
        return metrics, self._new_errors()

    async def wait(self) -> tuple[dict[str, float], list[str]]:
        """The sync in flight's metrics once done ({} if none), and new errors."""
        metrics = await self._wait()
        return metrics, self._new_errors()

    def _new_errors(self) -> list[str]:
        new = self.errors[self._errors_returned :]
        self._errors_returned = len(self.errors)
        return new

    async def _wait(self) -> dict[str, float]:
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
        if not self.views and not self.supervised:  # supervised: a replacement may come
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
        refs = [r.weight_digests.remote() for r in self.ranks]
        done = await self._bounded(asyncio.gather(*refs), 10 * self.s.timeout_s, "learner digests")
        return done[0]

    # ---- the learner-side command loop ------------------------------------------------------
    async def next_command(self, timeout_s: float) -> dict[str, Any] | None:
        """Long poll by the sender thread in learner rank 0 (single consumer)."""
        return await self.commands.next(timeout_s)

    def report(self, cid: int, kind: str, value: Any) -> None:
        self.commands.report(cid, kind, value)

    # ---- one sync ---------------------------------------------------------------------------
    async def _snapshot(self, version: int) -> dict[str, Any]:
        retain = sorted({v.held for v in self.views.values() if v.held != NO_VERSION})
        refs = [
            r.snapshot_weights.remote(self.id, version, retain, self.s.verify) for r in self.ranks
        ]
        snaps = await self._bounded(
            asyncio.gather(*refs),
            SNAPSHOT_TIMEOUTS * self.s.timeout_s,
            f"snapshot of version {version} on the learner",
        )
        self._n_buckets, self._last_snap = snaps[0]["buckets"], snaps[0]  # (membership.py)
        return snaps[0]

    async def _run_sync(self, version: int, snap: dict[str, Any], force: bool = False) -> dict:
        acc = SyncTally(version, time.monotonic(), snap["pack_seconds"], snap["nbytes"])
        waves = plan_waves(self.views, version, self.s.rolling_k, only_stale=not force)
        for wave in waves:
            retry = await self._run_wave(version, wave, snap, acc)
            live = {n: self.views[n] for n in retry if n in self.views}
            if live and self.s.retry:
                for again in plan_waves(live, version, 0):
                    await self._run_wave(version, again, snap, acc)
        return self._finish(acc)

    async def _run_wave(
        self, version: int, wave: list[SyncSet], snap: dict, acc: SyncTally
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

    async def _transfer(self, version: int, sset: SyncSet, acc: SyncTally):
        """Start one broadcast; returns once the sender is done (the members reload after)."""
        group, new = self._group_for(sset.members)
        cid = next(self._ids)
        futs = self.commands.post(
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
                    sender = futs["done"].result() if futs["done"].done() else no_report("open")
                    return sset, group, sender, refs
                group.port = futs["port"].result()
            order = self._order(version, group, sset)
            acc.t_ordered = time.time()
            refs = {
                n: self.actors[n].receive_weights.remote({**order, "rank_offset": group.ranks[n]})
                for n in sset.members
            }
            try:
                sender = await asyncio.wait_for(futs["done"], self._transfer_deadline_s() + SLACK_S)
            except TimeoutError:
                sender = no_report("send")
        finally:
            self.commands.forget(cid)
        acc.add_sender(sender)
        return sset, group, sender, refs

    async def _settle(self, version, sset, group, sender, refs, snap, acc) -> list[str]:
        """Judge each member of one set from its own result and the sender's report."""
        if not sender["ok"]:
            self._forget(sset.members, group)
        bad_ranks = culprits(group, sender, self.views)
        retry = []
        deadline = self._transfer_deadline_s() + self.s.pause_timeout_s + 2 * self.s.timeout_s
        for name in sset.members:
            res = await self._actor_result(name, refs.get(name), deadline + SLACK_S)
            res.setdefault("t_back", time.time())
            view = self.views.get(name)
            if view is None:  # removed meanwhile (a dead actor: asyncrl/fault/actors.py)
                continue
            if res.get("ok"):
                view.loaded, view.held, view.failures = version, res["held"], 0
                acc.add_actor(res)
                bad = digest_mismatch(name, res, snap)
                if bad:
                    self._error(acc, bad)
                continue
            view.held = res.get("held", NO_VERSION)
            at = where(sender if name in bad_ranks or not res.get("error") else res)
            why = [res.get("error")] + ([f"sender: {sender['error']}"] if not sender["ok"] else [])
            why_s = " | ".join(w for w in why if w) or "no result"
            msg = f"weight sync of version {version} to actor {name!r} failed at {at}: {why_s}"
            if res.get("dead") or not await self._alive(name):
                self._error(acc, msg)
                self._drop(name, msg)
            elif name in bad_ranks or sender["ok"]:
                view.failures += 1
                self._error(acc, msg)
                if view.failures >= self.s.max_failures:
                    self._drop(name, f"{view.failures} failed syncs in a row; last: {msg}")
            else:
                retry.append(name)  # a peer broke the group under it
        return retry

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

    def _finish(self, acc: SyncTally) -> dict[str, float]:
        metrics = acc.metrics(time.monotonic() - acc.t0, len(self.dead))
        self.totals["broker/syncs"] += 1
        for k in ("broker/bytes_sent", "broker/sync_seconds"):
            self.totals[k] += metrics[k]
        metrics.update({f"broker/version/{n}": float(v.loaded) for n, v in self.views.items()})
        return metrics

    # ---- groups ---------------------------------------------------------------------------
    def _group_for(self, members: tuple[str, ...]) -> tuple[Group, bool]:
        if members in self._groups:
            self._groups.move_to_end(members)
            return self._groups[members], False
        while len(self._groups) >= self.s.max_groups:
            old_members, old = self._groups.popitem(last=False)
            self._close_group(old_members, old)
        ranks, world = ranks_of(members, self.views)
        group = Group(f"{self.id}-g{next(self._ids)}", ranks, world)
        self._groups[members] = group
        return group, True

    def _forget(self, members: tuple[str, ...], group: Group) -> None:
        if self._groups.get(members) is group:
            del self._groups[members]
        self._close_group(members, group)

    def _close_group(self, members: tuple[str, ...], group: Group) -> None:
        self.commands.post({"op": "close", "keys": [group.key]})
        for n in members:
            if n in self.views:
                self.actors[n].close_weight_groups.remote([group.key])  # best effort

    def _order(self, version: int, group: Group, sset: SyncSet) -> dict[str, Any]:
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

    def _error(self, acc: SyncTally, msg: str) -> None:
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
