"""RolloutActor bookkeeping without an engine: the queue is faked at the Ray boundary."""

from __future__ import annotations

import asyncio
import functools

import pytest

from asyncrl.actor.engine import EngineSettings
from asyncrl.actor.rollout import RolloutActor, SamplingSettings
from asyncrl.tasks.arithmetic import AdditionTask


class _Queue:
    """What the actor calls on its queue actor, counted."""

    def __init__(self):
        self.abandoned = 0
        outer = self

        class _Abandon:
            def remote(self, n=1):
                outer.abandoned += n

        self.abandon = _Abandon()


def _actor(queue, **kw) -> RolloutActor:
    return RolloutActor(
        "t", "/nonexistent", AdditionTask(), queue, SamplingSettings(), EngineSettings(), **kw
    )


def test_a_group_cancelled_before_it_ran_frees_its_slot():
    """A task cancelled before its first step never runs its own finally: the done
    callback must still count it down and give its queue slot back."""

    async def main():
        q = _Queue()
        a = _actor(q, max_inflight_groups=4)
        ran = []

        async def group():
            ran.append(1)

        tasks = []
        for _ in range(3):
            a._n_inflight += 1
            t = asyncio.create_task(group())
            t.add_done_callback(functools.partial(a._group_done, q))
            tasks.append(t)
        tasks[0].cancel()  # before it ever ran
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0)  # done callbacks run on the next loop turn
        return a, q, ran

    a, q, ran = asyncio.run(main())
    assert len(ran) == 2  # the cancelled one never started
    assert a._n_inflight == 0 and q.abandoned == 1


def test_bad_actor_settings_are_named():
    with pytest.raises(ValueError, match="actor.max_inflight_groups"):
        _actor(_Queue(), max_inflight_groups=0)
    with pytest.raises(ValueError, match="actor.handoff_linger_ms"):
        _actor(_Queue(), handoff_linger_s=-0.01)
