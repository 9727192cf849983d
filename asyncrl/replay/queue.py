"""ReplayQueue: the Ray actor around :class:`ReplayBuffer`.

    actors ──acquire_many(k)──▶ waits while the buffer says no (backpressure / staleness
                                window), then grants up to k slots at once
    actor's Outbox ──hand_over(HandOff: metas, bundle key, its actor handle)──▶ queue
         queue ──actor.take_bundle(key)──▶ the actor serialises the bundle into the object
              store once, as the return value of the queue's call: the queue owns it
         queue ──▶ buffer (one ref per bundle; meta.bundle_index says where) ──▶ wakes
              get_batch waiters; up to `asked` free slots go back with the answer
    learner ──get_batch(n, V, timeout)──▶ evicts stale, waits for n ready groups or timeout
            ──resolve_groups(items)──▶ one ray.get of the bundles, from the object store
    loop ──set_max_staleness(BoundChange)──▶ the bound moves (replay.max_staleness=auto);
            narrowing evicts at once, widening wakes the throttled actors

Only ObjectRefs and small metadata live here; the queue never reads or copies
trajectory bytes. The bytes of a bundle are written once, by the actor that made them,
and the queue owns the object (Ray's owner is the caller of the call that returned it):
a bundle outlives the actor that made it, so groups a dead actor handed over stay
trainable (asyncrl/fault/actors.py). A bundle enters the buffer only once the actor's
return has arrived, so no queued ref points at an object that never came. Bundles under
Ray's inline limit (100 KiB) travel inside the reply and are kept in this process's
memory store, still unread.

Every Ray call costs about a millisecond of CPU on each side on a small machine, more
than generating a short group, so actors take slots and hand groups over in batches
(``acquire_many``, and :class:`Outbox`, whose hand-off also asks for slots). Each group
of a bundle is msgpack-encoded on its own, so a learner that takes one group of a
bundle decodes only that one: :func:`resolve_groups` reads bundles and plain
one-group refs alike.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from asyncrl.replay.buffer import UNPRIMED, BatchItem, GroupMeta, ReplayBuffer
from asyncrl.replay.outbox import HandOff
from asyncrl.replay.steer import BoundChange
from asyncrl.trajectory import TrajectoryGroup, from_bytes


class ReplayQueueCore:
    """The buffer behind one event loop: waiters wake when it changes. Run as a Ray
    actor by :func:`remote_queue` (its methods never race: one loop, no threads)."""

    def __init__(self, **buffer_kwargs: Any):
        self.buf = ReplayBuffer(**buffer_kwargs)
        self._changed = asyncio.Condition()
        self._closed = False
        self._weights: dict[str, int] = {}  # actor name -> policy version it holds
        # (outbox, bundle key) -> (actor, the take asked for before its hand-off came)
        self._ahead: dict[tuple[str, int], tuple[str | None, Any]] = {}

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def acquire(self, timeout_s: float = 1.0, actor: str | None = None) -> bool:
        """Reserve a slot for one group; False if none came free within ``timeout_s``
        (the caller loops, so it can notice shutdown instead of blocking forever).
        ``actor``: the caller's name, if it reports its weights (``set_weights_version``),
        so the staleness window counts from the weights it really holds."""

        def ok() -> bool:
            return self.buf.can_start(self._weights.get(actor) if actor else None)

        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self._closed or ok()), timeout_s
                )
            except TimeoutError:
                return False
            if self._closed:
                return False
            self.buf.start(actor)
            return True

    async def acquire_many(
        self, max_groups: int, timeout_s: float = 1.0, actor: str | None = None
    ) -> int:
        """Reserve up to ``max_groups`` slots: waits until at least one is free, then
        grants as many as the buffer allows right now; 0 if none came free within
        ``timeout_s``. ``actor`` as for :meth:`acquire`."""
        if max_groups < 1:
            return 0
        if not await self.acquire(timeout_s, actor):
            return 0
        return 1 + self._grant(max_groups - 1, actor)

    def _grant(self, max_groups: int, actor: str | None) -> int:
        """Up to ``max_groups`` slots the buffer allows right now, without waiting."""
        granted = 0
        version = self._weights.get(actor) if actor else None
        while granted < max_groups and not self._closed and self.buf.can_start(version):
            self.buf.start(actor)
            granted += 1
        return granted

    async def set_weights_version(self, actor: str, version: int) -> None:
        """``actor`` now generates with policy ``version`` (it calls this after each
        weight load); its waiting ``acquire`` calls look again."""
        self._weights[actor] = version
        await self._notify()

    async def abandon(self, num_groups: int = 1, actor: str | None = None) -> None:
        """``num_groups`` started groups will never be put (their generation failed);
        ``actor``: whose slots they were."""
        for _ in range(num_groups):
            self.buf.abandon(actor)
        await self._notify()

    async def actor_lost(self, actor: str) -> int:
        """``actor`` died (asyncrl/fault/actors.py): its granted slots are freed and
        counted lost, and until its replacement reports its first weight sync
        (``set_weights_version``) it gets no slot. Returns the groups lost."""
        n = self.buf.actor_lost(actor)
        self._weights[actor] = UNPRIMED
        for k in [k for k, (name, _) in self._ahead.items() if name == actor]:
            del self._ahead[k]  # its take fails, or waits on a dead actor
        await self._notify()
        return n

    async def hand_over(self, h: HandOff) -> tuple[list[str], int]:
        """The groups of one bundle go in (``h.metas``, in bundle order), then up to
        ``h.asked`` slots that are free right now (never waits: 0 when none is): an
        actor's hand-off asks for the slots its finished groups freed in the same call.
        The bundle is taken from ``h.source`` first, so the queue owns its object; if
        that fails (the actor died meanwhile) no group goes in and their slots are
        freed. Returns (refused, granted): one message per group that did not go in.

        The take of the outbox's next bundle is asked for right away: the actor answers
        it the moment that bundle exists, just before its hand-off leaves, so a steady
        hand-off finds its bundle here instead of waiting a round trip for it."""
        _, take = self._ahead.pop((h.outbox, h.bundle), (None, None))
        try:
            count, ref = take or self._take(h.source, h.bundle)
            await count  # the bundle is in the object store once its count is back
        except Exception as e:  # noqa: BLE001 - reported to the caller, if it still lives
            self._release(h.metas)
            await self._notify()
            why = f"bundle {h.bundle} not taken: {type(e).__name__}: {e}"
            return [f"group {m.group_id}: {why}" for m in h.metas], 0
        self._ahead[(h.outbox, h.bundle + 1)] = (h.actor, self._take(h.source, h.bundle + 1))
        items = [(ref, dataclasses.replace(m, bundle_index=i)) for i, m in enumerate(h.metas)]
        errors = self._put_items(items)
        granted = self._grant(h.asked, h.actor) if h.asked > 0 else 0
        await self._notify()
        return errors, granted

    @staticmethod
    def _take(source: Any, key: int) -> Any:
        """(the bundle's group count, the bundle): two refs this queue owns."""
        return source.take_bundle.options(num_returns=2).remote(key)

    def _release(self, metas: list[GroupMeta]) -> None:
        """Free the slots of groups that will never be put; an actor whose death was
        already reported (:meth:`actor_lost`) has none left to free."""
        for m in metas:
            if not m.actor or self.buf.running_by_actor.get(m.actor, 0) > 0:
                self.buf.abandon(m.actor)

    def _put_items(self, items: list[tuple[Any, GroupMeta]]) -> list[str]:
        """Each ``(ref, meta)`` in order; a group that cannot be put (its id was put
        before) frees its slot and the rest still go in. One message per refusal."""
        errors = []
        for ref, meta in items:
            try:
                self.buf.put(ref, meta)
            except Exception as e:  # noqa: BLE001 - reported to the caller
                self.buf.abandon(meta.actor)
                errors.append(f"group {meta.group_id}: {type(e).__name__}: {e}")
        return errors

    async def get_batch(
        self, num_groups: int, learner_version: int, timeout_s: float
    ) -> list[BatchItem] | None:
        """``num_groups`` whole groups, oldest first, none staler than the bound;
        ``None`` if they did not arrive within ``timeout_s``."""
        self.buf.set_learner_version(learner_version)
        await self._notify()  # a new version may open the staleness window for actors
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(
                        lambda: (
                            self.buf.evict_stale() >= 0 and self.buf.ready_groups() >= num_groups
                        )
                    ),
                    timeout_s,
                )
            except TimeoutError:
                return None
            items = self.buf.take(num_groups)
        await self._notify()  # taking frees capacity
        return items

    async def set_learner_version(self, version: int) -> None:
        self.buf.set_learner_version(version)
        await self._notify()

    async def set_max_staleness(self, change: BoundChange) -> int:
        """The staleness bound in force from now on (``replay.max_staleness=auto``):
        narrowing drops what it makes stale before any later ``get_batch`` can take it
        (one event loop: nothing runs between); widening wakes the throttled actors.
        Returns the trajectories it dropped."""
        dropped = self.buf.set_max_staleness(change.max_staleness)
        await self._notify()
        return dropped

    async def close(self) -> None:
        self._closed = True
        await self._notify()

    def stats(self) -> dict[str, Any]:
        return self.buf.stats()

    def state_dict(self) -> dict[str, Any]:
        return self.buf.state_dict()

    async def resume_from(self, state: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint's accounting merged into this live queue
        (:meth:`ReplayBuffer.resume_from`); its waiting actors look again."""
        stats = self.buf.resume_from(state)
        await self._notify()
        return stats


def resolve_groups(items: list[BatchItem]) -> list[TrajectoryGroup]:
    """The TrajectoryGroups behind queue items, in order: one ``ray.get`` for all of
    them, each bundle fetched once, only the groups asked for decoded."""
    import ray

    refs = list(dict.fromkeys(it.ref for it in items))  # ObjectRefs hash by object id
    got = dict(zip(refs, ray.get(refs)))
    out = []
    for it in items:
        obj = got[it.ref]
        if it.bundle_index < 0:
            out.append(obj)
        else:
            gid, data = obj[it.bundle_index]
            out.append(TrajectoryGroup(gid, from_bytes(data)))
    return out


def remote_queue(**buffer_kwargs: Any):
    """Start the queue as a Ray actor (one event loop: methods never race)."""
    import ray

    cls = ray.remote(num_cpus=0, max_concurrency=1000)(ReplayQueueCore)
    return cls.options(name=None).remote(**buffer_kwargs)
