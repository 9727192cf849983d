"""Outbox: a rollout actor's side of the replay queue's hand-off (replay/queue.py).

    actor start: outbox.introduce()  an empty hand-off while the engine loads
    actor: outbox.put(group, meta)  (returns at once)
    flush task, one call at a time: linger while the actor finds it worth it (SlotAsker)
        ─▶ bundle = [(group_id, msgpack bytes)] of every group put meanwhile, kept here
        ─▶ queue.hand_over(HandOff(metas, key, source, asked))
             queue ─▶ source.take_bundle(key) ─▶ Outbox.take(key): Ray writes the bundle
                      into the object store once, owned by the queue (the take of
                      key + 1 is asked for at once, answered once that bundle exists)
        ◀─ (refused, granted): the granted slots go to the actor (SlotAsker.answered)

One Outbox per actor and queue; the actor's host answers the queue's
``take_bundle(key)`` with :meth:`Outbox.take`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from asyncrl.replay.buffer import GroupMeta
from asyncrl.trajectory import TrajectoryGroup, to_bytes

if TYPE_CHECKING:
    from ray.actor import ActorHandle


@dataclass
class HandOff:
    """One :class:`Outbox` hand-off, actor -> queue: the metadata of one bundle's groups
    (in bundle order), where the queue takes the bundle from, and the slots asked for."""

    metas: list[GroupMeta]
    bundle: int  # the key ``source.take_bundle`` answers to (Outbox.take)
    source: ActorHandle  # the Ray actor holding the bundle: take_bundle(key) -> (n, bundle)
    asked: int = 0  # free slots to grant with the answer (never waited for)
    actor: str | None = None  # whose slots: the throttle window counts from its weights
    outbox: str = ""  # which Outbox (its bundle keys count up from 0)
    kind: str = "hand_off"


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
    """An actor's side of ``ReplayQueueCore.hand_over`` (replay/queue.py): :meth:`put` returns at once;
    one call at a time carries everything that completed since the last one left (after
    waiting ``linger_s`` for more), so groups that finish one by one still travel
    together. The groups of one hand-off form one bundle (``[(group_id, msgpack
    bytes)]``), kept here until the queue takes it through its ``source``'s
    ``take_bundle(key)`` (which answers :meth:`take`): written to the object store once,
    owned by the queue.

    With ``slots`` (an actor's :class:`SlotAsker`), each hand-off also asks for the slots
    the actor has free, so a steady actor needs one queue call per hand-off, not two.
    The linger ends as soon as the actor says it is no longer worth it
    (:meth:`look_again`, ``SlotAsker.worth_lingering``): when nothing is left
    generating, nothing more can come along and the learner may be waiting for these
    groups (the staleness window is shut, or the run's last groups); when many slots
    wait for this hand-off, the engine is running out of work.

    A failed call is not retried (the queue actor is gone, or it refused a group): the
    first error is kept in :attr:`error` and the groups' slots are freed where possible.
    """

    def __init__(
        self, queue: Any, linger_s: float = 0.0, slots: SlotAsker | None = None,
        source: ActorHandle | None = None,
    ):  # fmt: skip
        """``source``: the Ray actor whose ``take_bundle(key)`` returns :meth:`take`
        (None: the Ray actor this outbox runs in, looked up at the first hand-off)."""
        self.queue = queue
        self.linger_s = linger_s
        self.slots = slots
        self.source = source
        self._items: list[tuple[TrajectoryGroup, GroupMeta]] = []
        self._bundles: dict[int, list[tuple[str, bytes]]] = {}  # handed over, not yet taken
        self._next_key = 0
        self._stored = asyncio.Event()  # a bundle was stored: a waiting take looks again
        self._closed = False
        self.id = uuid.uuid4().hex
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

    async def take(self, key: int) -> tuple[int, list[tuple[str, bytes]]]:
        """The bundle of hand-off ``key`` and its group count, given up: the queue's
        call that returns it owns the object Ray makes of it. The queue asks for the
        next key ahead of its hand-off: that waits until its bundle is stored."""
        while key not in self._bundles:
            if key < self._next_key or self._closed:
                raise KeyError(f"bundle {key} is gone: taken, or its hand-off failed")
            self._stored.clear()
            await self._stored.wait()
        bundle = self._bundles.pop(key)
        return len(bundle), bundle

    def introduce(self) -> Coroutine[Any, Any, None]:
        """The first hand-off, sent now: no groups, no slots asked. The queue's first
        sight of an actor's handle costs seconds (Ray loads the actor's class in the
        queue's process: 4.2 s for a RolloutActor on the Intel host), so an actor
        introduces itself before its engine starts and pays it while the engine loads,
        not while its first groups wait for their hand-off. Await what this returns
        once the actor's loop is free (the queue takes the empty bundle from it); a
        failure is kept in :attr:`error`."""
        key, self._next_key = self._next_key, self._next_key + 1
        self._bundles[key] = []
        self._stored.set()
        name = self.slots.name if self.slots is not None else None
        call = self.queue.hand_over.remote(HandOff([], key, self._source(), 0, name, self.id))
        return self._introduced(key, call)

    async def _introduced(self, key: int, call: Any) -> None:
        try:
            await call
        except Exception as e:  # noqa: BLE001 - recorded; the owner reports it
            self.error = self.error or f"queue.hand_over failed: {type(e).__name__}: {e}"
        finally:
            self._bundles.pop(key, None)

    def close(self) -> None:
        """No more hand-offs (the actor goes to another queue): takes that wait fail."""
        self._closed = True
        self._stored.set()

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
            key, self._next_key = self._next_key, self._next_key + 1
            asked = got = 0
            try:
                self._bundles[key] = [(g.group_id, to_bytes(g.trajectories)) for g, _ in batch]
                self._stored.set()
                asked = self.slots.ask() if self.slots is not None else 0
                name = self.slots.name if self.slots is not None else None
                metas = [meta for _, meta in batch]
                h = HandOff(metas, key, self._source(), asked, name, self.id)
                refused, got = await self.queue.hand_over.remote(h)
            except Exception as e:  # noqa: BLE001 - recorded; the owner reports it
                self._failed(e, len(batch))
                continue
            finally:
                self._bundles.pop(key, None)  # taken, or never will be
                if self.slots is not None:
                    self.slots.answered(asked, got)
            self.granted += got
            self.sent_groups += len(batch) - len(refused)
            if refused:
                self.error = (
                    self.error or f"the queue refused {len(refused)} group(s): {refused[0]}"
                )

    def _failed(self, e: Exception, n: int) -> None:
        """Nothing went in (the call never ran, or the queue is gone): free the ``n``
        groups' slots if the queue can still hear it."""
        self.error = self.error or f"queue.hand_over failed: {type(e).__name__}: {e}"
        try:
            self.queue.abandon.remote(n, self.slots and self.slots.name)
        except Exception:  # noqa: BLE001 - the queue itself is gone
            pass

    def _source(self) -> ActorHandle:
        if self.source is None:
            import ray

            self.source = ray.get_runtime_context().current_actor
        return self.source

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
