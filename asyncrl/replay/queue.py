"""ReplayQueue: the Ray actor around :class:`ReplayBuffer`.

    actors ──acquire_many(k)──▶ waits while the buffer says no (backpressure / staleness
                                window), then grants up to k slots at once
    actors ──put_many([([ref], meta), ...])──▶ buffer ──▶ wakes get_batch waiters
             (Outbox: one ray.put of a bundle per hand-off; meta.bundle_index says where)
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
from typing import Any

from asyncrl.replay.buffer import BatchItem, GroupMeta, ReplayBuffer
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
            self.buf.start()
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
        granted = 1
        version = self._weights.get(actor) if actor else None
        while granted < max_groups and not self._closed and self.buf.can_start(version):
            self.buf.start()
            granted += 1
        return granted

    async def set_weights_version(self, actor: str, version: int) -> None:
        """``actor`` now generates with policy ``version`` (it calls this after each
        weight load); its waiting ``acquire`` calls look again."""
        self._weights[actor] = version
        await self._notify()

    async def abandon(self, num_groups: int = 1) -> None:
        """``num_groups`` started groups will never be put (their generation failed)."""
        for _ in range(num_groups):
            self.buf.abandon()
        await self._notify()

    async def put(self, ref_list: list, meta: GroupMeta) -> None:
        self.buf.put(ref_list[0], meta)
        await self._notify()

    async def put_many(self, items: list[tuple[list, GroupMeta]]) -> list[str]:
        """Several ``(ref_list, meta)`` at once, in order. A group that cannot be put
        (e.g. its id was put before) frees its slot and the rest still go in; returns
        one message per group that was refused (empty when all went in)."""
        errors = []
        for ref_list, meta in items:
            try:
                self.buf.put(ref_list[0], meta)
            except Exception as e:  # noqa: BLE001 - reported to the caller
                self.buf.abandon()
                errors.append(f"group {meta.group_id}: {type(e).__name__}: {e}")
        await self._notify()
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


class Outbox:
    """An actor's side of ``put_many``: :meth:`put` returns at once; one call at a time
    carries everything that completed since the last one left (after waiting
    ``linger_s`` for more), so groups that finish one by one still travel together.
    The groups of one hand-off go into the object store together, in one ``ray.put``.

    A failed call is not retried (the queue actor is gone, or it refused a group): the
    first error is kept in :attr:`error` and the groups' slots are freed where possible.
    """

    def __init__(self, queue: Any, linger_s: float = 0.0):
        self.queue = queue
        self.linger_s = linger_s
        self._items: list[tuple[list, GroupMeta]] = []
        self._task: asyncio.Task | None = None
        self.error: str = ""
        self.sent_groups = 0
        self.calls = 0

    def put(self, group: TrajectoryGroup, meta: GroupMeta) -> None:
        self._items.append((group, meta))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._flush())

    async def _flush(self) -> None:
        import ray

        while self._items:
            if self.linger_s > 0:  # let the groups finishing right now come along
                await asyncio.sleep(self.linger_s)
            batch, self._items = self._items, []
            self.calls += 1
            try:
                ref = ray.put([(g.group_id, to_bytes(g.trajectories)) for g, _ in batch])
                items = [
                    ([ref], dataclasses.replace(meta, bundle_index=i))
                    for i, (_, meta) in enumerate(batch)
                ]
                refused = await self.queue.put_many.remote(items)
            except Exception as e:  # noqa: BLE001 - recorded; the owner reports it
                # Nothing went in (the call never ran, or the queue is gone): free the
                # slots if the queue can still hear it.
                self.error = self.error or f"queue.put_many failed: {type(e).__name__}: {e}"
                try:
                    self.queue.abandon.remote(len(batch))
                except Exception:  # noqa: BLE001 - the queue itself is gone
                    pass
                continue
            self.sent_groups += len(batch) - len(refused)
            if refused:
                self.error = (
                    self.error or f"the queue refused {len(refused)} group(s): {refused[0]}"
                )

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
