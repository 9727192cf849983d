"""Ray's process boundary around the replay queue, faked for tests that run the queue
(``ReplayQueueCore``) or an ``Outbox`` in the test's own process."""

from __future__ import annotations

import asyncio
import time

from asyncrl.replay.buffer import GroupMeta
from asyncrl.replay.outbox import HandOff


class FakeSource:
    """The actor handle a hand-off names: ``take_bundle.options(num_returns=2)
    .remote(key)`` answers (a count to await, the ref ``"bundle-<key>"``); with
    ``dead`` the count raises, as a call on a dead actor does."""

    def __init__(self, dead: bool = False):
        self.dead = dead
        self.take_bundle = self

    def options(self, num_returns: int) -> FakeSource:
        assert num_returns == 2
        return self

    def remote(self, key: int):
        return _Count(self.dead), f"bundle-{key}"


class _Count:
    """A group count to await (never awaited when the queue asked ahead for it)."""

    def __init__(self, dead: bool):
        self.dead = dead

    def __await__(self):
        if self.dead:
            raise ConnectionError("actor died")
        return 1
        yield  # a generator: awaitable


def hand_off(
    metas: list[GroupMeta], key: int = 0, asked: int = 0, actor: str | None = None,
    dead: bool = False,
) -> HandOff:  # fmt: skip
    """A hand-off of ``metas`` as bundle ``key`` from a :class:`FakeSource`."""
    return HandOff(metas, key, FakeSource(dead), asked, actor)


def _done(value):
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(value)
    return fut


class DeadQueue:
    """A queue actor handle whose actor died: every hand_over raises; the slots given
    back (abandon) are recorded."""

    def __init__(self):
        self.abandoned: list[int] = []
        outer = self

        class _HandOver:
            def remote(self, h: HandOff):
                async def fail():
                    raise ConnectionError("actor died")

                return asyncio.ensure_future(fail())

        class _Abandon:
            def remote(self, n: int = 1, actor: str | None = None) -> None:
                outer.abandoned.append(n)

        self.hand_over, self.abandon = _HandOver(), _Abandon()


class OkQueue:
    """A queue actor handle whose hand_over takes everything and grants nothing, and
    records when each call came and how many groups it carried."""

    def __init__(self):
        self.calls: list[tuple[float, int]] = []
        outer = self

        class _HandOver:
            def remote(self, h: HandOff):
                outer.calls.append((time.monotonic(), len(h.metas)))
                return _done(([], 0))

        self.hand_over = _HandOver()
