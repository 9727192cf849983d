"""ReplayQueue: the Ray actor around :class:`ReplayBuffer`.

    actors ──acquire_many(k)──▶ waits while the buffer says no (backpressure / staleness
                                window), then grants up to k slots at once
    actors ──put_many([([ref], meta), ...])──▶ buffer ──▶ wakes get_batch waiters
             (Outbox: one bundle per hand-off, put by the queue, which so owns it and
             keeps it past its actor's death; meta.bundle_index says where)
    learner ──get_batch(n, V, timeout)──▶ evicts stale, waits for n ready groups or timeout

Only ObjectRefs and small metadata live here; the trajectories stay in the object
store where the actor put them. Refs are passed wrapped in a list so Ray hands the
reference through instead of resolving it.

Every Ray call costs about a millisecond of CPU on each side on a small machine, more
than generating a short group, so actors take slots and hand groups over in batches
(``acquire_many``, and :class:`Outbox` for ``put_many``); ``acquire``/``put`` remain
for one at a time. A ``ray.put`` costs as much again, so the Outbox puts the groups of
one hand-off as one bundle (each group msgpack-encoded on its own, so a learner that
takes one group of a bundle decodes only that one): :func:`resolve_groups` reads
either kind of ref.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Protocol

from asyncrl.replay.buffer import UNPRIMED, BatchItem, GroupMeta, ReplayBuffer
from asyncrl.trajectory import TrajectoryGroup, from_bytes, to_bytes


class ReplayQueueCore:
    """Async wrapper, usable in-process (tests) or as a Ray actor (``ReplayQueue``)."""

    def __init__(self, **buffer_kwargs: Any):
        self.buf = ReplayBuffer(**buffer_kwargs)
        self._changed = asyncio.Condition()
        self._closed = False
        self._weights: dict[str, int] = {}  # actor name -> policy version it holds

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
        await self._notify()
        return n

    async def put(self, ref_list: list, meta: GroupMeta) -> None:
        self.buf.put(ref_list[0], meta)
        await self._notify()

    async def put_many(self, items: list[tuple[list, GroupMeta]]) -> list[str]:
        """Several ``(ref_list, meta)`` at once, in order. A group that cannot be put
        (e.g. its id was put before) frees its slot and the rest still go in; returns
        one message per group that was refused (empty when all went in)."""
        errors = self._put_items(items)
        await self._notify()
        return errors

    async def hand_over(
        self, items: list[tuple[list, GroupMeta]], max_groups: int = 0, actor: str | None = None
    ) -> tuple[list[str], int]:
        """:meth:`put_many`, then up to ``max_groups`` slots that are free right now
        (never waits: 0 when none is): an actor's hand-off asks for the slots its
        finished groups freed in the same call. Returns (refused, granted)."""
        errors = self._put_items(items)
        granted = self._grant(max_groups, actor) if max_groups > 0 else 0
        await self._notify()
        return errors, granted

    async def hand_over_bundle(
        self, bundle: list, metas: list[GroupMeta], max_groups: int = 0, actor: str | None = None
    ) -> tuple[list[str], int]:
        """:meth:`hand_over` of the groups of one bundle (``[(group_id, bytes)]``, in
        the order of ``metas``), put into the object store HERE: the queue owns the
        object, so queued groups outlive the actor that made them (an object dies with
        its owner, and Ray 2.56 removed ``ray.put(_owner=)``). The cost: the bundle is
        decoded and encoded once more here (bytes, not arrays)."""
        import ray

        ref = ray.put(bundle)
        items = [([ref], dataclasses.replace(m, bundle_index=i)) for i, m in enumerate(metas)]
        return await self.hand_over(items, max_groups, actor)

    def _put_items(self, items: list[tuple[list, GroupMeta]]) -> list[str]:
        errors = []
        for ref_list, meta in items:
            try:
                self.buf.put(ref_list[0], meta)
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


class SlotAsker(Protocol):
    """What an :class:`Outbox` asks its actor around a hand-off."""

    name: str  # the actor's name (the queue's throttle window counts from its weights)

    def ask(self) -> int:
        """How many slots to ask for now (reserved until :meth:`answered`)."""
        ...

    def answered(self, asked: int, granted: int) -> None:
        """The queue granted ``granted`` of ``asked`` (0 of them if the call failed)."""
        ...

    def outbox_idle(self) -> None:
        """The outbox has handed everything over and has no call in flight."""
        ...

    def worth_lingering(self) -> bool:
        """Whether a hand-off may still wait for more groups: some are generating, and
        the slots that wait for this hand-off to be asked for again are still few
        enough that the engine stays fed."""
        ...


class Outbox:
    """An actor's side of ``put_many``: :meth:`put` returns at once; one call at a time
    carries everything that completed since the last one left (after waiting
    ``linger_s`` for more), so groups that finish one by one still travel together.
    The groups of one hand-off go into the object store together, in one ``ray.put``
    the queue makes (:meth:`ReplayQueueCore.hand_over_bundle`: the queue owns them).

    With ``slots`` (an actor's :class:`SlotAsker`), each hand-off is a
    :meth:`ReplayQueueCore.hand_over` that also asks for the slots the actor has free,
    so a steady actor needs one queue call per hand-off, not two. The linger ends as
    soon as the actor says it is no longer worth it (:meth:`look_again`,
    ``SlotAsker.worth_lingering``): when nothing is left generating, nothing more can
    come along and the learner may be waiting for these groups (the staleness window
    is shut, or the run's last groups); when many slots wait for this hand-off, the
    engine is running out of work.

    A failed call is not retried (the queue actor is gone, or it refused a group): the
    first error is kept in :attr:`error` and the groups' slots are freed where possible.
    """

    def __init__(self, queue: Any, linger_s: float = 0.0, slots: SlotAsker | None = None):
        self.queue = queue
        self.linger_s = linger_s
        self.slots = slots
        self._items: list[tuple[list, GroupMeta]] = []
        self._task: asyncio.Task | None = None
        self.error: str = ""
        self.sent_groups = 0
        self.calls = 0
        self.granted = 0  # slots granted along with hand-offs
        self._flushing = False
        self._looked = asyncio.Event()  # the actor's groups changed: the linger looks again

    def put(self, group: TrajectoryGroup, meta: GroupMeta) -> None:
        self._items.append((group, meta))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._flush())

    @property
    def busy(self) -> bool:
        """Groups waiting to go, or a hand-off in flight (which will ask for slots)."""
        return self._flushing or bool(self._items)

    async def _flush(self) -> None:
        self._flushing = True
        try:
            await self._flush_all()
        finally:
            self._flushing = False
            if self.slots is not None:
                self.slots.outbox_idle()

    async def _flush_all(self) -> None:
        while self._items:
            if self.linger_s > 0:  # let the groups finishing right now come along
                await self._linger()
            batch, self._items = self._items, []
            self.calls += 1
            asked = got = 0
            call = "hand_over_bundle"
            try:
                bundle = [(g.group_id, to_bytes(g.trajectories)) for g, _ in batch]
                metas = [meta for _, meta in batch]
                asked = self.slots.ask() if self.slots is not None else 0
                name = self.slots.name if self.slots is not None else None
                refused, got = await self.queue.hand_over_bundle.remote(bundle, metas, asked, name)
            except Exception as e:  # noqa: BLE001 - recorded; the owner reports it
                # Nothing went in (the call never ran, or the queue is gone): free the
                # slots if the queue can still hear it.
                self.error = self.error or f"queue.{call} failed: {type(e).__name__}: {e}"
                try:
                    self.queue.abandon.remote(len(batch), self.slots and self.slots.name)
                except Exception:  # noqa: BLE001 - the queue itself is gone
                    pass
                continue
            finally:
                if self.slots is not None:
                    self.slots.answered(asked, got)
            self.granted += got
            self.sent_groups += len(batch) - len(refused)
            if refused:
                self.error = (
                    self.error or f"the queue refused {len(refused)} group(s): {refused[0]}"
                )

    def look_again(self) -> None:
        """The actor's groups changed: a linger asks ``slots.worth_lingering`` again."""
        self._looked.set()

    async def _linger(self) -> None:
        """``linger_s``, or (with ``slots``) until lingering is no longer worth it."""
        if self.slots is None:
            await asyncio.sleep(self.linger_s)
            return
        loop = asyncio.get_running_loop()
        end = loop.time() + self.linger_s
        while self.slots.worth_lingering():
            self._looked.clear()
            left = end - loop.time()
            if left <= 0:
                return
            try:
                await asyncio.wait_for(self._looked.wait(), left)
            except TimeoutError:
                return

    @property
    def pending(self) -> int:
        return len(self._items)

    async def drain(self) -> None:
        """Until everything put so far has been handed over (or failed)."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)
        if self._items:  # put after the last flush ended
            self._task = asyncio.create_task(self._flush())
            await asyncio.shield(self._task)


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
