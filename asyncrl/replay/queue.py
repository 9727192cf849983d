"""ReplayQueue: the Ray actor around :class:`ReplayBuffer`.

    actors ──acquire()──▶ waits while the buffer says no (backpressure / staleness window)
    actors ──put([ref], meta)──▶ buffer ──▶ wakes get_batch waiters
    learner ──get_batch(n, V, timeout)──▶ evicts stale, waits for n ready groups or timeout

Only ObjectRefs and small metadata live here; the trajectories stay in the object
store where the actor put them. Refs are passed wrapped in a list so Ray hands the
reference through instead of resolving it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from asyncrl.replay.buffer import BatchItem, GroupMeta, ReplayBuffer


class ReplayQueueCore:
    """Async wrapper, usable in-process (tests) or as a Ray actor (``ReplayQueue``)."""

    def __init__(self, **buffer_kwargs: Any):
        self.buf = ReplayBuffer(**buffer_kwargs)
        self._changed = asyncio.Condition()
        self._closed = False

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def acquire(self, timeout_s: float = 1.0) -> bool:
        """Reserve a slot for one group; False if none came free within ``timeout_s``
        (the caller loops, so it can notice shutdown instead of blocking forever)."""
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self._closed or self.buf.can_start()), timeout_s
                )
            except TimeoutError:
                return False
            if self._closed:
                return False
            self.buf.start()
            return True

    async def abandon(self) -> None:
        self.buf.abandon()
        await self._notify()

    async def put(self, ref_list: list, meta: GroupMeta) -> None:
        self.buf.put(ref_list[0], meta)
        await self._notify()

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


def remote_queue(**buffer_kwargs: Any):
    """Start the queue as a Ray actor (one event loop: methods never race)."""
    import ray

    cls = ray.remote(num_cpus=0, max_concurrency=1000)(ReplayQueueCore)
    return cls.options(name=None).remote(**buffer_kwargs)
