"""The hand-off: an actor's Outbox bundles its finished groups, the queue takes the
bundle from the actor (so the queue owns the one object Ray writes), puts the groups
and grants the slots free by then. Queue and Outbox in-process with Ray's boundary
faked (tests/replay_fakes.py), then through a real ReplayQueue actor and a real
producer actor that is killed after its hand-off."""

from __future__ import annotations

import asyncio
import sys
import time

from replay_fakes import DeadQueue, OkQueue, hand_off

from asyncrl.replay.buffer import GroupMeta
from asyncrl.replay.outbox import Outbox
from asyncrl.replay.queue import ReplayQueueCore


def meta(gid: str, versions: list[int], actor: str = "") -> GroupMeta:
    n = len(versions)
    return GroupMeta(gid, [f"{gid}-{i}" for i in range(n)], versions, [10] * n, [0.0] * n,
                     actor=actor)  # fmt: skip


def _group(gid: str, n: int = 2, extra: int = 0):
    """``n`` trajectories; member i has ``i + 1 + extra`` response tokens."""
    import numpy as np

    from asyncrl.trajectory import Trajectory, TrajectoryGroup

    trajs = [
        Trajectory(
            f"{gid}-{i}",
            gid,
            np.arange(3, dtype=np.int32),
            np.arange(i + 1 + extra, dtype=np.int32),
            -np.ones(i + 1 + extra, np.float32),
            np.zeros(i + 1 + extra, np.int32),
            np.ones(i + 1 + extra, bool),
            float(i),
        )
        for i in range(n)
    ]
    return TrajectoryGroup(gid, trajs), meta(gid, [0] * n)


# ---- the queue's side, in-process -------------------------------------------------------
def test_hand_over_puts_then_grants_only_what_is_free_now():
    """The actor's hand-off: its groups go in first, then up to k slots the throttle
    window allows at that moment; with the window shut it returns 0 at once."""

    async def main():
        q = ReplayQueueCore(max_staleness=1, batch_groups=2)  # window: 4 groups at V=0
        assert await q.acquire_many(5, 0.1, "a0") == 4
        t0 = asyncio.get_running_loop().time()
        refused, granted = await q.hand_over(hand_off([meta("a", [0], "a0")], 0, 5, "a0"))
        assert (refused, granted) == ([], 0)  # window shut: no wait, no slot
        assert asyncio.get_running_loop().time() - t0 < 0.05
        await q.set_weights_version("a0", 1)
        assert len(await q.get_batch(1, 1, timeout_s=0.1)) == 1  # V=1: 2 more slots
        refused, granted = await q.hand_over(hand_off([meta("b", [0], "a0")], 1, 5, "a0"))
        assert (refused, granted) == ([], 2)
        assert await q.hand_over(hand_off([], 2)) == ([], 0)
        s = q.stats()
        assert s["groups_running"] == 4 and s["produced"] == 2 and s["trained"] == 1

    asyncio.run(main())


def test_a_bundle_keeps_order_and_a_duplicate_is_refused_without_losing_the_rest():
    async def main():
        q = ReplayQueueCore(max_staleness=5, batch_groups=3, policy="drop")
        assert await q.acquire_many(4, 0.1) == 4
        refused, _ = await q.hand_over(
            hand_off([meta("a", [0, 0]), meta("b", [0]), meta("a", [0])], key=0)
        )
        assert len(refused) == 1 and "group a" in refused[0] and "twice" in refused[0]
        assert (await q.hand_over(hand_off([meta("c", [0])], key=1)))[0] == []
        s = q.stats()
        assert s["groups_running"] == 0  # the refused group freed its slot
        assert s["produced"] == 4 and s["produced"] == s["trained"] + s["in_flight"]
        items = await q.get_batch(3, 0, timeout_s=1.0)
        assert [(it.ref, it.bundle_index) for it in items] == [
            ("bundle-0", 0), ("bundle-0", 1), ("bundle-1", 0)
        ]  # fmt: skip

    asyncio.run(main())


def test_a_bundle_that_cannot_be_taken_frees_its_slots_once():
    """The actor died between its hand-off and the queue's take: no group goes in,
    their slots are freed, and a death the supervisor reports first (actor_lost)
    is not freed a second time."""

    async def main():
        q = ReplayQueueCore(max_staleness=5, batch_groups=2, capacity_groups=100)
        assert await q.acquire_many(3, 0.1, "a0") == 3
        assert await q.acquire_many(2, 0.1, "b0") == 2
        refused, granted = await q.hand_over(
            hand_off([meta("a", [0], "a0"), meta("b", [0], "a0")], 0, 4, "a0", dead=True)
        )
        assert granted == 0 and len(refused) == 2 and "actor died" in refused[0]
        s = q.stats()
        assert s["groups_running"] == 3 and s["produced"] == 0 and s["depth_groups"] == 0
        assert await q.actor_lost("a0") == 1  # the third slot
        await q.hand_over(hand_off([meta("c", [0], "a0")], 1, 0, "a0", dead=True))
        assert q.stats()["groups_running"] == 2  # b0's two are still running

    asyncio.run(main())


# ---- the Outbox, with the queue faked ----------------------------------------------------
def test_outbox_failure_is_recorded_and_slots_freed():
    async def main():
        dead = DeadQueue()
        box = Outbox(dead, source=object())
        for i in range(3):
            box.put(*_group(f"g{i}"))
        await box.drain()
        return box, dead

    box, dead = asyncio.run(main())
    assert "queue.hand_over failed" in box.error and "actor died" in box.error
    assert box.sent_groups == 0 and sum(dead.abandoned) == 3
    assert box._bundles == {}  # nothing kept for a take that will never come


class _Slots:
    """An actor's slot bookkeeping as the Outbox sees it (replay.outbox.SlotAsker)."""

    name = "a0"

    def __init__(self, free: int):
        self.free, self.answers, self.idle = free, [], 0

    def ask(self) -> int:
        return self.free

    def answered(self, asked: int, granted: int) -> None:
        self.answers.append((asked, granted))

    def outbox_idle(self) -> None:
        self.idle += 1

    worth = False  # the actor's answer to "may a hand-off wait for more groups?"

    def worth_lingering(self) -> bool:
        return self.worth


def test_outbox_hand_over_failure_answers_the_ask_and_frees_the_slots():
    """A hand-off whose call fails still answers the slot request (0 granted), so the
    actor does not keep the slots reserved; the groups' slots are given back."""

    async def main():
        dead, slots = DeadQueue(), _Slots(free=3)
        box = Outbox(dead, slots=slots, source=object())
        for i in range(2):
            box.put(*_group(f"g{i}"))
        await box.drain()
        return box, dead, slots

    box, dead, slots = asyncio.run(main())
    assert "queue.hand_over failed" in box.error and "actor died" in box.error
    assert slots.answers and all(got == 0 for _, got in slots.answers)
    assert slots.idle >= 1 and box.granted == 0 and sum(dead.abandoned) == 2


def test_outbox_lingers_only_while_the_actor_finds_it_worth_it():
    """The linger waits for groups still generating to come along, and ends at once
    when the actor says it no longer pays (nothing is generating: the last groups
    before a shut staleness window, or the run's end, go to the learner without
    waiting out the linger; or too many slots wait for the hand-off)."""
    linger = 5.0

    async def main():
        q, slots = OkQueue(), _Slots(free=0)
        box = Outbox(q, linger_s=linger, slots=slots, source=object())
        slots.worth = True  # another group is generating: wait for it
        t0 = time.monotonic()
        box.put(*_group("g0"))
        await asyncio.sleep(0.2)
        assert q.calls == []  # still lingering
        box.put(*_group("g1"))  # the other group came
        slots.worth = False
        box.look_again()
        await box.drain()
        assert len(q.calls) == 1 and q.calls[0][1] == 2  # together, in one call
        assert q.calls[0][0] - t0 < 0.2 + 1.0  # not the whole linger
        # not worth it from the start: no linger at all
        t1 = time.monotonic()
        box.put(*_group("g2"))
        await box.drain()
        assert len(q.calls) == 2 and q.calls[1][0] - t1 < 1.0
        return box

    box = asyncio.run(main())
    assert (box.calls, box.sent_groups, box.error) == (2, 3, "")


def test_groups_being_scored_do_not_hold_a_hand_off_back():
    """A group being scored no longer needs the engine: once every in-flight group is
    only waiting for its rewards, a hand-off stops lingering (a slow reward answers when
    it answers, and the learner may be waiting for the groups that would linger)."""
    from asyncrl.actor.handoff import Slots

    slots = Slots("a", max_inflight=8, on_granted=lambda n: None)
    slots.inflight, slots.asking = 2, 6  # the loop's ask holds every free slot
    assert slots.free() < slots.refill and slots.worth_lingering()
    assert slots.scoring_changed(1) is False  # one still generating: worth waiting for
    assert slots.worth_lingering()
    assert slots.scoring_changed(1) is True  # none generating: look again, and go
    assert not slots.worth_lingering()
    assert slots.scoring_changed(-1) is False and slots.scoring == 1


def test_the_reward_client_says_when_a_group_is_being_scored():
    """RewardClient.on_scoring: +1 when a group's scoring begins, -1 when its rewards
    are in, also when the reward fails."""
    from asyncrl.rewards.base import RewardInput
    from asyncrl.rewards.pool import RewardClient

    seen: list[tuple[int, int]] = []

    class SlowWorker:
        class score:  # noqa: N801 - a Ray actor method's shape: score.remote(inputs)
            @staticmethod
            def remote(inputs):
                async def answer():
                    seen.append(("asked", len(inputs)))
                    await asyncio.sleep(0.05)
                    raise RuntimeError("worker lost")

                return answer()

    async def main():
        client = RewardClient(workers=[SlowWorker()])
        client.on_scoring = lambda d: seen.append(("scoring", d))
        x = RewardInput("1+1=", "2", [5], "2", {}, 0.0)
        out = await client.score([x, x])
        return out

    out = asyncio.run(main())
    assert seen == [("scoring", 1), ("asked", 2), ("scoring", -1)]
    assert all(s.error for s in out)


class _TakingQueue:
    """A queue actor handle that takes each bundle as ReplayQueueCore.hand_over does:
    the first when its hand-off comes, each next one asked for ahead of it."""

    def __init__(self, box_of):
        self.box_of, self.ahead, self.got = box_of, None, []
        outer = self

        class _HandOver:
            def remote(self, h):
                return asyncio.ensure_future(outer._hand_over(h))

        self.hand_over = _HandOver()

    async def _hand_over(self, h):
        box = self.box_of()
        _, bundle = await (self.ahead or box.take(h.bundle))
        self.got += [gid for gid, _ in bundle]
        self.ahead = asyncio.ensure_future(box.take(h.bundle + 1))
        return [], 0


def test_a_take_asked_ahead_waits_for_its_bundle_and_fails_once_closed():
    async def main():
        q = _TakingQueue(lambda: box)
        box = Outbox(q, source=object())
        box.put(*_group("g0"))
        await box.drain()
        await asyncio.sleep(0.01)
        assert q.got == ["g0"] and not q.ahead.done()  # bundle 1 does not exist yet
        for i in (1, 2, 3):
            box.put(*_group(f"g{i}"))
        await box.drain()
        assert q.got == ["g0", "g1", "g2", "g3"] and box._bundles == {}
        waiting = q.ahead
        box.close()  # the actor goes to another queue
        try:
            await waiting
        except KeyError as e:
            return box, str(e)
        return box, ""

    box, why = asyncio.run(main())
    assert "is gone" in why and box.error == ""


# ---- real Ray: a producer actor, the queue actor, the learner's resolve -------------------
BIG = 50_000  # response tokens: a group of ~1 MB, stored in the object store's shared memory


class _Producer:
    """A Ray actor handing groups over through its Outbox, as a rollout actor does."""

    def __init__(self, queue):
        self.box = Outbox(queue)

    async def take_bundle(self, key: int):
        return await self.box.take(key)

    async def hand_over(self, n: int) -> tuple[int, int, str, int]:
        """``n`` groups: the first goes alone, the rest are made while it travels. The
        first is big enough for Ray's shared-memory store, the others' bundle travels
        inline (under 100 KiB)."""
        self.box.put(*_group("g0", extra=BIG))
        await asyncio.sleep(0)  # the first hand-off leaves
        for i in range(1, n):
            self.box.put(*_group(f"g{i}"))
        await self.box.drain()
        return self.box.calls, self.box.sent_groups, self.box.error, len(self.box._bundles)


def test_outbox_bundles_outlive_the_actor_that_made_them(ray_local):
    """Through a real ReplayQueue actor: the first group goes alone, the 19 made while
    it travels go in one more call and one bundle. The producer is then killed: the
    queue owns the bundles, so the learner's resolve_groups still gets every group
    back, in order, fetching each bundle once; a plain one-group ref resolves too."""
    import ray
    from ray import cloudpickle

    from asyncrl.replay.buffer import BatchItem
    from asyncrl.replay.queue import remote_queue, resolve_groups

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    q = remote_queue(max_staleness=5, batch_groups=1, policy="drop", capacity_groups=50)
    p = ray.remote(_Producer).options(num_cpus=0).remote(q)
    try:
        assert ray.get(q.acquire_many.remote(20, 1.0)) == 20
        assert ray.get(p.hand_over.remote(20)) == (2, 20, "", 0)
        ray.kill(p, no_restart=True)
        items = ray.get(q.get_batch.remote(20, 0, 5.0))
        assert [it.bundle_index for it in items] == [0, *range(19)]
        assert len(set(it.ref for it in items)) == 2
        groups = resolve_groups(items)
        assert [g.group_id for g in groups] == [f"g{i}" for i in range(20)]
        assert [t.traj_id for t in groups[7].trajectories] == ["g7-0", "g7-1"]
        assert groups[7].trajectories[1].response_ids.tolist() == [0, 1]
        assert groups[0].trajectories[1].response_ids.size == BIG + 2
        s = ray.get(q.stats.remote())
        assert s["groups_running"] == 0 and s["produced"] == s["trained"] == 40
        g, _ = _group("solo")
        item = BatchItem(ray.put(g), "solo", ["solo-0", "solo-1"], [0, 0], 1)
        assert resolve_groups([item])[0].group_id == "solo"
    finally:
        ray.kill(q)
