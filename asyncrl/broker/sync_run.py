"""One published version's process-group sync, driven from the WeightBroker's event loop.

    run(V, snapshot): waves of sync sets (plan.py: rolling_k, grouped by held version)
      per set, one after another (rank 0 sends to one group at a time):
        [new group] rank 0 ◀── SendOrder(open_world) ... Listening(port) ──▶ here
        rank 0 ◀── SendOrder ─┐ at once
        each member ◀── ReceiveOrder: pause, receive + reload in place, resume
        ◀── SendDone (deadline)
      per wave: ◀── each member's Reloaded (deadline)
      failure: the error names actor, bucket, version; a dead actor is dropped;
      live members of a failed set are retried once, in a fresh group

Every await on a peer has a deadline on top of the transport's own timeouts.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from asyncrl.broker.membership import Roster
from asyncrl.broker.messages import (
    CloseGroups,
    ReceiveOrder,
    Reloaded,
    SendDone,
    SendOrder,
    Snapshot,
)
from asyncrl.broker.plan import SyncSet, plan_waves, ranks_of
from asyncrl.broker.settings import BrokerSettings
from asyncrl.broker.sync import Group, SyncTally, culprits, digest_mismatch, where

# Slack on top of the transport's own deadlines before the broker gives up on a
# Ray call (process scheduling, RPC hops): the transport normally fails first.
SLACK_S = 30.0
# The workers' reload after the transfer: at least this long before a deadline fires.
MIN_APPLY_S = 60.0
# The actor's label and resume after the reload (actor/weights.py RPC_TIMEOUT_S).
RESUME_S = 60.0


@dataclass
class Launched:
    """One set whose transfer finished (or failed): the members' pending answers."""

    sset: SyncSet
    group: Group
    sender: SendDone
    refs: dict[str, Any]


class GroupCache:
    """Process groups by member tuple, least recently used closed first."""

    def __init__(self, broker_id: str, roster: Roster, rank0: Any, max_groups: int):
        self.broker_id, self.roster, self.rank0 = broker_id, roster, rank0
        self.max_groups = max_groups
        self._groups: OrderedDict[tuple[str, ...], Group] = OrderedDict()
        self._ids = itertools.count()

    def get(self, members: tuple[str, ...], roster: Roster) -> tuple[Group, bool]:
        """The cached group of ``members``, or a new one (True)."""
        if members in self._groups:
            self._groups.move_to_end(members)
            return self._groups[members], False
        while len(self._groups) >= self.max_groups:
            old_members, old = self._groups.popitem(last=False)
            self._close(old_members, old)
        ranks, world = ranks_of(members, roster.views)
        group = Group(f"{self.broker_id}-g{next(self._ids)}", ranks, world)
        self._groups[members] = group
        return group, True

    def by_key(self, key: str) -> Group | None:
        return next((g for g in self._groups.values() if g.key == key), None)

    def forget(self, members: tuple[str, ...], group: Group) -> None:
        if self._groups.get(members) is group:
            del self._groups[members]
        self._close(members, group)

    def forget_actor(self, name: str) -> None:
        for members, group in list(self._groups.items()):
            if name in members:
                self.forget(members, group)

    def _close(self, members: tuple[str, ...], group: Group) -> None:
        order = CloseGroups((group.key,))
        self.rank0.close_send_groups.remote(order)  # best effort, as below
        for n in members:
            if n in self.roster.views:
                self.roster.actors[n].close_weight_groups.remote(order)


class SyncRun:
    """Brings every actor of ``roster`` to a version (``run``), one set at a time."""

    def __init__(self, s: BrokerSettings, roster: Roster, groups: GroupCache, rank0: Any):
        self.s, self.roster, self.groups, self.rank0 = s, roster, groups, rank0
        self.host, self.backend = "", ""  # where rank 0 listens, once attached
        self.n_buckets = 1  # of the last snapshot: bounds a transfer's deadline

    async def run(self, version: int, snap: Snapshot, force: bool = False) -> SyncTally:
        acc = SyncTally(version, time.monotonic(), snap.pack_seconds, snap.nbytes)
        views = self.roster.views
        for wave in plan_waves(views, version, self.s.rolling_k, only_stale=not force):
            retry = await self._wave(version, wave, snap, acc)
            live = {n: views[n] for n in retry if n in views}
            if live and self.s.retry:
                for again in plan_waves(live, version, 0):
                    await self._wave(version, again, snap, acc)
        return acc

    async def _wave(
        self, version: int, wave: list[SyncSet], snap: Snapshot, acc: SyncTally
    ) -> list[str]:
        """Transfer to each set in turn, then await every member's reload. Returns the
        live members that failed only because a peer did (retry them)."""
        launched = []
        for sset in wave:
            sset = SyncSet(tuple(m for m in sset.members if m in self.roster.views), sset.base)
            if sset.members:
                launched.append(await self._transfer(version, sset, acc))
        retry: list[str] = []
        for one in launched:
            retry += await self._settle(version, one, snap, acc)
        return retry

    async def _transfer(self, version: int, sset: SyncSet, acc: SyncTally) -> Launched:
        """Order rank 0 to send and the members to receive; returns once rank 0 is done
        (the members' answers come after their reloads)."""
        group, new = self.groups.get(sset.members, self.roster)
        if new:
            group.listening = asyncio.get_running_loop().create_future()
        order = SendOrder(
            group.key, version, sset.base, self.s.mode, self._arrive_timeout_s(sset.members),
            open_world=group.world if new else 0, shards=self._shards(sset.members),
            with_digests=self.s.verify,
        )  # fmt: skip
        done = asyncio.ensure_future(self._sent(order, new))
        if new:
            await asyncio.wait(
                {group.listening, done},
                timeout=self.s.join_timeout_s + SLACK_S,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if not group.listening.done():
                sender = done.result() if done.done() else SendDone.missing(group.key, "open")
                acc.add_sender(sender)
                return Launched(sset, group, sender, {})
            group.port = group.listening.result()
        acc.t_ordered = time.time()
        refs = {
            n: self.roster.actors[n].receive_weights.remote(self._receive_order(version, group, n))
            for n in sset.members
        }
        sender = await done
        acc.add_sender(sender)
        return Launched(sset, group, sender, refs)

    async def _sent(self, order: SendOrder, new: bool) -> SendDone:
        """Rank 0's answer to ``order``, or why there is none within its deadline."""
        import ray

        deadline = self.transfer_deadline_s(new) + SLACK_S
        try:
            return await asyncio.wait_for(self.rank0.send_weights.remote(order), deadline)
        except TimeoutError:
            return SendDone.missing(order.key, "send")
        except ray.exceptions.RayActorError as e:
            return SendDone(order.key, False, error=f"learner rank 0 died: {e}", peer_ranks=(0,))

    async def _settle(self, version: int, one: Launched, snap: Snapshot, acc: SyncTally):
        """Judge each member of one set from its own answer and the sender's."""
        sset, group, sender = one.sset, one.group, one.sender
        if not sender.ok:
            self.groups.forget(sset.members, group)
        bad_ranks = culprits(group, sender, self.roster.views)
        retry = []
        for name in sset.members:
            res = await self._answer(name, version, one.refs.get(name))
            view = self.roster.views.get(name)
            if view is None:  # removed meanwhile (a dead actor: asyncrl/fault/actors.py)
                continue
            view.update_mode = res.update_mode or view.update_mode
            if res.ok:
                view.loaded, view.held, view.failures = version, res.held, 0
                acc.add_actor(res, time.time())
                bad = digest_mismatch(name, res, snap, sender.shard_digests)
                if bad:
                    self._error(acc, bad)
                continue
            view.held = res.held
            if await self._failed(version, name, res, sender, name in bad_ranks, acc):
                retry.append(name)
        return retry

    async def _failed(
        self, version: int, name: str, res: Reloaded, sender: SendDone, culprit: bool,
        acc: SyncTally,
    ) -> bool:  # fmt: skip
        """Record ``name``'s failed update; True when only a peer broke it (retry)."""
        view = self.roster.views[name]
        at = where(sender.bucket if culprit or not res.error else res.bucket)
        why = [res.error] + ([f"sender: {sender.error}"] if not sender.ok else [])
        why_s = " | ".join(w for w in why if w) or "no result"
        msg = f"weight sync of version {version} to actor {name!r} failed at {at}: {why_s}"
        if res.dead or not await self._alive(name):
            self._error(acc, msg)
            self.roster.drop(name, msg)
        elif culprit or sender.ok:
            view.failures += 1
            self._error(acc, msg)
            if view.failures >= self.s.max_failures:
                self.roster.drop(name, f"{view.failures} failed syncs in a row; last: {msg}")
        else:
            return True  # a peer broke the group under it
        return False

    async def _answer(self, name: str, version: int, ref: Any) -> Reloaded:
        import ray

        if ref is None:  # never ordered: the set failed before its members were
            return Reloaded(name, version, held=self.roster.views[name].held)
        timeout_s = self._receive_deadline_s() + self.s.pause_timeout_s + RESUME_S + SLACK_S
        try:
            return await asyncio.wait_for(ref, timeout_s)
        except TimeoutError:
            return Reloaded(name, version, error=f"actor did not answer within {timeout_s:.0f}s")
        except ray.exceptions.RayActorError as e:
            return Reloaded(name, version, dead=True, error=f"actor process died: {e}")

    async def _alive(self, name: str) -> bool:
        """Can the actor still serve (its process and its engine answer)?"""
        try:
            await asyncio.wait_for(self.roster.actors[name].weight_state.remote(), self.s.timeout_s)
            return True
        except Exception:  # noqa: BLE001 - any failure to answer means it cannot serve
            return False

    def _shards(self, members: tuple[str, ...]) -> int:
        """The engines' TP size when every member's workers get only their shard
        (``broker.reshard``, every member with the same number of workers > 1), else 0."""
        sizes = {self.roster.views[m].workers for m in members}
        size = sizes.pop() if len(sizes) == 1 else 0
        return size if self.s.reshard and size > 1 else 0

    def _receive_order(self, version: int, group: Group, name: str) -> ReceiveOrder:
        s = self.s
        return ReceiveOrder(
            group.key, self.host, group.port, group.ranks[name], group.world, version,
            self.backend, s.timeout_s, s.join_timeout_s, s.pause_timeout_s,
            deadline_s=self._receive_deadline_s(),
            hold_copy=s.hold_copy, with_digests=s.verify, engine_api=s.engine_api,
        )  # fmt: skip

    def _error(self, acc: SyncTally, msg: str) -> None:
        acc.errors.append(msg)
        self.roster.error(msg)

    # ---- deadlines --------------------------------------------------------------------
    def _arrive_timeout_s(self, members: tuple[str, ...]) -> float:
        """The members pause generation before they enter: under ``wait`` the requests
        in flight finish first (``pause_timeout_s``); the other modes pause at once."""
        views = self.roster.views
        drains = any(views[m].update_mode == "wait" for m in members if m in views)
        return self.s.timeout_s + (self.s.pause_timeout_s if drains else 0.0)

    def transfer_deadline_s(self, new: bool) -> float:
        """Upper bound of one set's transfer: join, arrivals (a draining member at
        worst), every bucket's collective."""
        join = self.s.join_timeout_s if new else 0.0
        arrive = self.s.timeout_s + self.s.pause_timeout_s
        return join + arrive + (self.n_buckets + 4) * self.s.timeout_s

    def _receive_deadline_s(self) -> float:
        """Bound of the workers' one call: the transfer, then the in-place reload."""
        return self.transfer_deadline_s(True) + max(self.s.timeout_s, MIN_APPLY_S)

    def backstop_s(self) -> float:
        """Upper bound of a whole sync (every actor in its own set, each retried once)."""
        per_set = self._receive_deadline_s() + self.s.pause_timeout_s + RESUME_S
        return 2 * (len(self.roster.views) + 1) * (per_set + SLACK_S)
