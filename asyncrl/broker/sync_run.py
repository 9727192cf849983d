"""One published version's process-group sync, driven from the WeightBroker's event loop.

    run(V, snapshot): waves of sync sets (plan.py: rolling_k, grouped by held version)
      per set, one after another (rank 0 sends to one group at a time):
        [new group] rank 0 ◀── SendOrder(open_world) ... Listening(port) ──▶ here
        rank 0 ◀── SendOrder ─┐ at once
        direct (a snapshot of engine shards, ``Snapshot.tp`` = T): the senders of
          shards 1..T-1 ◀── SendOrder(tp, port) too, once rank 0 listens; their SendDones
          are combined (sync.py ``combine_sends``); the members' ranks start at T
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
from dataclasses import dataclass, replace
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
from asyncrl.broker.sync import (
    Group,
    SyncTally,
    combine_sends,
    culprits,
    digest_mismatch,
    where,
)

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
    """Process groups by member tuple, least recently used closed first. ``senders``:
    the learner ranks that may send (rank 0 first; a group uses its first ``senders``)."""

    def __init__(self, broker_id: str, roster: Roster, senders: list[Any], max_groups: int):
        self.broker_id, self.roster, self.senders = broker_id, roster, senders
        self.max_groups = max_groups
        self._groups: OrderedDict[tuple[str, ...], Group] = OrderedDict()
        self._ids = itertools.count()

    def get(self, members: tuple[str, ...], roster: Roster, senders: int = 1) -> tuple[Group, bool]:
        """The cached group of ``members`` sent to by ``senders`` learner ranks, or a new
        one (True); a cached group of other senders is closed first."""
        cached = self._groups.get(members)
        if cached is not None and cached.senders == senders:
            self._groups.move_to_end(members)
            return cached, False
        if cached is not None:
            self.forget(members, cached)
        while len(self._groups) >= self.max_groups:
            old_members, old = self._groups.popitem(last=False)
            self._close(old_members, old)
        ranks, world = ranks_of(members, roster.views, senders)
        group = Group(f"{self.broker_id}-g{next(self._ids)}", ranks, world, senders=senders)
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
        for rank in self.senders[: group.senders]:
            rank.close_send_groups.remote(order)  # best effort, as below
        for n in members:
            if n in self.roster.views:
                self.roster.actors[n].close_weight_groups.remote(order)


class SyncRun:
    """Brings every actor of ``roster`` to a version (``run``), one set at a time."""

    def __init__(self, s: BrokerSettings, roster: Roster, groups: GroupCache, senders: Any):
        # senders: the learner ranks' handles, rank 0 first (direct: engine shard t's at t)
        self.s, self.roster, self.groups, self.senders = s, roster, groups, senders
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
                launched.append(await self._transfer(version, sset, acc, snap.tp))
        retry: list[str] = []
        for one in launched:
            retry += await self._settle(version, one, snap, acc)
        return retry

    async def _transfer(self, version: int, sset: SyncSet, acc: SyncTally, tp: int) -> Launched:
        """Order rank 0 (direct, ``tp`` > 1: each sender of an engine shard) to send and the members
        to receive; returns once the senders are done (the members' answers come after
        their reloads)."""
        group, new = self.groups.get(sset.members, self.roster, max(tp, 1))
        if new:
            group.listening = asyncio.get_running_loop().create_future()
        order = SendOrder(
            group.key, version, sset.base, self.s.mode, self._arrive_timeout_s(sset.members),
            open_world=group.world if new else 0, shards=self._shards(sset.members),
            with_digests=self.s.verify, tp=tp if tp > 1 else 0,
        )  # fmt: skip
        done = asyncio.ensure_future(self._sent(order, new, 0))
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
        joined = replace(order, open_world=0, port=group.port, host=self.host,
                         join_world=group.world if new else 0)  # fmt: skip
        others = [asyncio.ensure_future(self._sent(joined, new, r)) for r in range(1, tp)]
        acc.t_ordered = time.time()
        refs = {
            n: self.roster.actors[n].receive_weights.remote(self._receive_order(version, group, n))
            for n in sset.members
        }
        sender = combine_sends([await done] + [await o for o in others])
        acc.add_sender(sender)
        return Launched(sset, group, sender, refs)

    async def _sent(self, order: SendOrder, new: bool, rank: int) -> SendDone:
        """Learner rank ``rank``'s answer to ``order``, or why there is none within its
        deadline."""
        import ray

        deadline = self.transfer_deadline_s(new) + SLACK_S
        try:
            return await asyncio.wait_for(self.senders[rank].send_weights.remote(order), deadline)
        except TimeoutError:
            return SendDone.missing(order.key, "send", rank)
        except ray.exceptions.RayActorError as e:
            return SendDone(
                order.key, False, error=f"learner rank {rank} died: {e}", peer_ranks=(rank,)
            )

    async def _settle(self, version: int, one: Launched, snap: Snapshot, acc: SyncTally):
        """Judge each member of one set from its own answer and the sender's."""
        sset, group, sender = one.sset, one.group, one.sender
        if not sender.ok:
            self.groups.forget(sset.members, group)
        learners = sorted(p for p in sender.peer_ranks if p < group.senders)
        if not sender.ok and group.senders > 1 and learners:
            self._error(
                acc, f"weight sync of version {version}: the learner's sender(s) of engine shard(s) "
                f"{learners} failed "
                f"at {where(sender.bucket)}: {sender.error}",
            )  # fmt: skip
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
