"""ReplayBuffer / ReplayQueueCore: staleness bound, group-complete batches, reuse,
backpressure and exact accounting (produced == trained + dropped + in_queue)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from asyncrl.replay.buffer import GroupMeta, ReplayBuffer
from asyncrl.replay.queue import ReplayQueueCore


def meta(gid: str, versions: list[int]) -> GroupMeta:
    return GroupMeta(
        gid,
        [f"{gid}-{i}" for i in range(len(versions))],
        versions,
        [10] * len(versions),
        [0.0] * len(versions),
    )


def check_accounting(buf: ReplayBuffer) -> None:
    s = buf.stats()
    assert s["produced"] == s["trained"] + s["dropped_stale"] + s["in_flight"], s


def test_fifo_whole_groups_and_accounting():
    buf = ReplayBuffer(max_staleness=2, batch_groups=2)
    for g in "abc":
        buf.start()
        buf.put(f"ref-{g}", meta(g, [0, 0, 0]))
    check_accounting(buf)
    items = buf.take(2)
    assert [it.group_id for it in items] == ["a", "b"]
    assert all(len(it.traj_ids) == 3 for it in items)
    assert buf.take(2) == []  # only one group left: no partial batch
    s = buf.stats()
    assert (s["produced"], s["trained"], s["in_flight"]) == (9, 6, 3)
    check_accounting(buf)


def test_stale_samples_are_dropped_per_trajectory_and_counted():
    buf = ReplayBuffer(max_staleness=1, batch_groups=1)
    buf.start()
    buf.put("r", meta("g", [0, 3, 2]))  # member 0 will be too old at V=3
    buf.set_learner_version(3)
    (item,) = buf.take(1)
    assert item.traj_ids == ["g-1", "g-2"]
    assert item.staleness == [0, 1]
    s = buf.stats()
    assert s["dropped_stale"] == 1 and s["trained"] == 2 and s["max_staleness_trained"] == 1
    check_accounting(buf)


def test_evict_stale_skips_the_walk_only_when_nothing_can_be_stale():
    """evict_stale returns early while the oldest queued trajectory is within the
    bound; checked against a full walk after every change, with reuse re-queueing."""
    rng = random.Random(1)
    buf = ReplayBuffer(max_staleness=1, batch_groups=2, policy="drop", max_reuse=2)
    version = 0
    for step in range(400):
        for j in range(rng.randint(0, 3)):
            buf.start()
            lo = max(0, version - rng.randint(0, 3))
            buf.put(f"r{step}-{j}", meta(f"g{step}-{j}", [rng.randint(lo, version)] * 2))
        if rng.random() < 0.3:
            buf.take(2)
        if rng.random() < 0.4:
            version += rng.randint(1, 2)
            buf.set_learner_version(version)
        buf.evict_stale()
        for e in buf._queue.values():  # the full walk: nothing alive is stale
            for alive, v in zip(e.alive, e.meta.min_versions):
                assert not alive or version - v <= buf.max_staleness
        check_accounting(buf)
    assert buf.stats()["dropped_stale"] > 0


def test_never_hands_out_beyond_bound_random():
    rng = random.Random(0)
    buf = ReplayBuffer(max_staleness=2, batch_groups=3, policy="drop")
    version = 0
    for step in range(300):
        for _ in range(rng.randint(0, 4)):
            buf.start()
            lo = max(0, version - rng.randint(0, 5))
            buf.put(
                f"r{step}-{_}", meta(f"g{step}-{_}", [rng.randint(lo, version) for _ in range(4)])
            )
        for it in buf.take(3):
            assert max(it.staleness) <= 2
        if rng.random() < 0.5:
            version += 1
            buf.set_learner_version(version)
        check_accounting(buf)
    assert buf.stats()["dropped_stale"] > 0  # the test did exercise dropping


def test_throttle_window_and_dropped_groups_free_their_slot():
    buf = ReplayBuffer(max_staleness=1, batch_groups=2, policy="throttle", capacity_groups=100)
    started = 0
    while buf.can_start():
        buf.start()
        started += 1
    assert started == (0 + 1 + 1) * 2  # (V + max_staleness + 1) * batch_groups
    for i in range(started):
        buf.put(f"r{i}", meta(f"g{i}", [0]))
    buf.set_learner_version(2)  # every queued group is now too stale
    assert buf.take(2) == []
    assert buf.stats()["dropped_stale"] == started
    assert buf.can_start()  # dropped groups no longer hold the window shut
    check_accounting(buf)


def test_backpressure_capacity():
    buf = ReplayBuffer(max_staleness=10, batch_groups=1, policy="drop", capacity_groups=3)
    for _ in range(3):
        assert buf.can_start()
        buf.start()
    assert not buf.can_start()
    buf.put("r", meta("g", [0]))
    assert not buf.can_start()  # queued + running still 3
    buf.take(1)
    assert buf.can_start()


def test_reuse_counts_trained_once():
    buf = ReplayBuffer(max_staleness=5, batch_groups=1, max_reuse=3)
    buf.start()
    buf.put("r", meta("g", [0, 0]))
    uses = [buf.take(1)[0].use for _ in range(3)]
    assert uses == [1, 2, 3]
    assert buf.take(1) == []
    s = buf.stats()
    assert s["trained"] == 2 and s["samples_trained"] == 6
    check_accounting(buf)


def test_delay_mode_gives_exact_staleness():
    buf = ReplayBuffer(max_staleness=3, batch_groups=1, delay_versions=2)
    buf.start()
    buf.put("r", meta("g", [5, 5]))
    buf.set_learner_version(6)
    assert buf.take(1) == []
    buf.set_learner_version(7)
    (item,) = buf.take(1)
    assert item.staleness == [2, 2]


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="replay.max_staleness"):
        ReplayBuffer(max_staleness=-1, batch_groups=1)
    with pytest.raises(ValueError, match="replay.policy"):
        ReplayBuffer(max_staleness=1, batch_groups=1, policy="bogus")
    with pytest.raises(ValueError, match="delay_versions"):
        ReplayBuffer(max_staleness=1, batch_groups=1, delay_versions=2)


def test_queue_core_blocks_and_wakes():
    async def main():
        q = ReplayQueueCore(max_staleness=1, batch_groups=1, policy="drop")
        assert await q.get_batch(1, 0, timeout_s=0.05) is None  # times out, no hang

        async def producer():
            assert await q.acquire(1.0)
            await asyncio.sleep(0.05)
            await q.put(["ref"], meta("g", [0]))

        got, _ = await asyncio.gather(q.get_batch(1, 0, timeout_s=2.0), producer())
        assert [it.ref for it in got] == ["ref"]
        await q.close()
        assert await q.acquire(0.1) is False

    asyncio.run(main())


def test_acquire_many_grants_what_the_window_allows():
    async def main():
        # throttle window at version 0: (0 + 1 + 1) * 2 = 4 groups may start
        q = ReplayQueueCore(max_staleness=1, batch_groups=2, capacity_groups=100)
        assert await q.acquire_many(3, 0.1) == 3
        assert await q.acquire_many(3, 0.1) == 1  # only one left in the window
        assert await q.acquire_many(3, 0.05) == 0  # window full: times out, no hang
        assert await q.acquire_many(0, 0.05) == 0
        assert q.stats()["groups_running"] == 4
        await q.set_learner_version(1)  # the window opens by batch_groups
        assert await q.acquire_many(5, 0.1) == 2
        await q.abandon(2)
        assert q.stats()["groups_running"] == 4
        await q.close()
        assert await q.acquire_many(5, 0.05) == 0

    asyncio.run(main())


def test_hand_over_puts_then_grants_only_what_is_free_now():
    """The actor's hand-off: its groups go in first, then up to k slots the throttle
    window allows at that moment; with the window shut it returns 0 at once."""

    async def main():
        q = ReplayQueueCore(max_staleness=1, batch_groups=2)  # window: 4 groups at V=0
        assert await q.acquire_many(5, 0.1, "a0") == 4
        t0 = asyncio.get_running_loop().time()
        refused, granted = await q.hand_over([(["ra"], meta("a", [0]))], 5, "a0")
        assert (refused, granted) == ([], 0)  # window shut: no wait, no slot
        assert asyncio.get_running_loop().time() - t0 < 0.05
        await q.set_weights_version("a0", 1)
        assert len(await q.get_batch(1, 1, timeout_s=0.1)) == 1  # V=1: 2 more slots
        refused, granted = await q.hand_over([(["rb"], meta("b", [0]))], 5, "a0")
        assert (refused, granted) == ([], 2)
        assert await q.hand_over([], 0) == ([], 0)
        s = q.stats()
        assert s["groups_running"] == 4 and s["produced"] == 2 and s["trained"] == 1

    asyncio.run(main())


def test_put_many_keeps_order_and_refuses_a_duplicate_without_losing_the_rest():
    async def main():
        q = ReplayQueueCore(max_staleness=5, batch_groups=3, policy="drop")
        assert await q.acquire_many(4, 0.1) == 4
        refused = await q.put_many(
            [(["ra"], meta("a", [0, 0])), (["rb"], meta("b", [0])), (["ra2"], meta("a", [0]))]
        )
        assert len(refused) == 1 and "group a" in refused[0] and "twice" in refused[0]
        await q.put_many([(["rc"], meta("c", [0]))])
        s = q.stats()
        assert s["groups_running"] == 0  # the refused group freed its slot
        assert s["produced"] == 4 and s["produced"] == s["trained"] + s["in_flight"]
        items = await q.get_batch(3, 0, timeout_s=1.0)
        assert [it.ref for it in items] == ["ra", "rb", "rc"]

    asyncio.run(main())


def _group(gid: str, n: int = 2):
    import numpy as np

    from asyncrl.trajectory import Trajectory, TrajectoryGroup

    trajs = [
        Trajectory(
            f"{gid}-{i}",
            gid,
            np.arange(3, dtype=np.int32),
            np.arange(i + 1, dtype=np.int32),
            -np.ones(i + 1, np.float32),
            np.zeros(i + 1, np.int32),
            np.ones(i + 1, bool),
            float(i),
        )
        for i in range(n)
    ]
    return TrajectoryGroup(gid, trajs), meta(gid, [0] * n)


def test_outbox_coalesces_bundles_and_loses_none(ray_local):
    """Through a real ReplayQueue actor: the first group goes alone, the 19 made while
    it travels go in one more call and one bundle; the learner's resolve_groups gets
    every group back, in order, fetching each bundle once."""
    import ray

    from asyncrl.replay.queue import Outbox, remote_queue, resolve_groups

    q = remote_queue(max_staleness=5, batch_groups=1, policy="drop", capacity_groups=50)

    async def main():
        box = Outbox(q)
        assert await q.acquire_many.remote(20, 1.0) == 20
        box.put(*_group("g0"))
        await asyncio.sleep(0)  # the first hand-off leaves
        for i in range(1, 20):
            box.put(*_group(f"g{i}"))
        await box.drain()
        return box

    try:
        box = asyncio.run(main())
        assert (box.calls, box.sent_groups, box.error) == (2, 20, "")
        items = ray.get(q.get_batch.remote(20, 0, 5.0))
        assert [it.bundle_index for it in items] == [0, *range(19)]
        assert len(set(it.ref for it in items)) == 2
        groups = resolve_groups(items)
        assert [g.group_id for g in groups] == [f"g{i}" for i in range(20)]
        assert [t.traj_id for t in groups[7].trajectories] == ["g7-0", "g7-1"]
        assert groups[7].trajectories[1].response_ids.tolist() == [0, 1]
        s = ray.get(q.stats.remote())
        assert s["groups_running"] == 0 and s["produced"] == s["trained"] == 40
        # a plain one-group ref (queue.put) resolves alongside bundles
        assert ray.get(q.acquire.remote(1.0))
        g, m = _group("solo")
        ray.get(q.put.remote([ray.put(g)], m))
        (item,) = ray.get(q.get_batch.remote(1, 0, 5.0))
        assert item.bundle_index == -1 and resolve_groups([item])[0].group_id == "solo"
    finally:
        ray.kill(q)


class _DeadQueue:
    """A queue actor handle whose actor died (Ray's process boundary, faked): every
    put_many raises; abandon calls are counted."""

    def __init__(self):
        self.abandoned = []
        outer = self

        class _PutMany:
            def remote(self, items, *args):
                async def fail():
                    raise ConnectionError("actor died")

                return asyncio.ensure_future(fail())

        class _Abandon:
            def remote(self, n=1, actor=None):
                outer.abandoned.append(n)

        self.put_many, self.abandon = _PutMany(), _Abandon()
        self.hand_over_bundle = self.put_many  # the Outbox's call (the queue puts the bundle)


def test_outbox_failure_is_recorded_and_slots_freed(ray_local):
    from asyncrl.replay.queue import Outbox

    async def main():
        dead = _DeadQueue()
        box = Outbox(dead)
        for i in range(3):
            box.put(*_group(f"g{i}"))
        await box.drain()
        return box, dead

    box, dead = asyncio.run(main())
    assert "hand_over_bundle failed" in box.error and "actor died" in box.error
    assert box.sent_groups == 0 and sum(dead.abandoned) == 3


class _Slots:
    """An actor's slot bookkeeping as the Outbox sees it (replay.queue.SlotAsker)."""

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


def test_outbox_hand_over_failure_answers_the_ask_and_frees_the_slots(ray_local):
    """A hand-off whose call fails still answers the slot request (0 granted), so the
    actor does not keep the slots reserved; the groups' slots are given back."""
    from asyncrl.replay.queue import Outbox

    async def main():
        dead = _DeadQueue()
        dead.hand_over = dead.put_many  # same failure, the call the actor makes
        slots = _Slots(free=3)
        box = Outbox(dead, slots=slots)
        for i in range(2):
            box.put(*_group(f"g{i}"))
        await box.drain()
        return box, dead, slots

    box, dead, slots = asyncio.run(main())
    assert "hand_over_bundle failed" in box.error and "actor died" in box.error
    assert slots.answers and all(got == 0 for _, got in slots.answers)
    assert slots.idle >= 1 and box.granted == 0 and sum(dead.abandoned) == 2


class _OkQueue:
    """A queue actor handle whose hand_over takes everything and grants nothing, and
    records when each call came (the process boundary, faked)."""

    def __init__(self):
        self.calls = []
        outer = self

        class _HandOver:
            def remote(self, items, *asked_name):  # hand_over_bundle: metas too
                outer.calls.append((time.monotonic(), len(items)))
                fut = asyncio.get_running_loop().create_future()
                fut.set_result(([], 0))
                return fut

        self.hand_over = self.hand_over_bundle = _HandOver()  # (bundle, metas, asked, name)


def test_outbox_lingers_only_while_the_actor_finds_it_worth_it(ray_local):
    """The linger waits for groups still generating to come along, and ends at once
    when the actor says it no longer pays (nothing is generating: the last groups
    before a shut staleness window, or the run's end, go to the learner without
    waiting out the linger; or too many slots wait for the hand-off)."""
    from asyncrl.replay.queue import Outbox

    linger = 5.0

    async def main():
        q, slots = _OkQueue(), _Slots(free=0)
        box = Outbox(q, linger_s=linger, slots=slots)
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


def test_throttle_window_counts_from_the_weights_an_actor_holds():
    """An actor whose weights lag the learner (a sync on its way) may start only the
    groups that stay within the bound with its weights: no sample made to be dropped."""

    async def main():
        q = ReplayQueueCore(max_staleness=1, batch_groups=2, capacity_groups=100)
        await q.set_learner_version(3)  # window by the learner alone: (3+1+1)*2 = 10
        await q.set_weights_version("a0", 1)  # a0 holds version 1: (1+1+1)*2 = 6
        assert await q.acquire_many(20, 0.1, "a0") == 6
        assert await q.acquire_many(20, 0.05, "a0") == 0  # held back, no hang
        assert await q.acquire_many(20, 0.1) == 4  # no report: the learner's version

        async def later():
            await asyncio.sleep(0.05)
            await q.set_learner_version(4)
            await q.set_weights_version("a0", 4)  # the sync landed: waiters look again

        got, _ = await asyncio.gather(q.acquire_many(20, 2.0, "a0"), later())
        assert got == 2  # (4+1+1)*2 = 12 started in all
        # a group started with weights v is trained by version n // batch_groups
        buf = ReplayBuffer(max_staleness=1, batch_groups=2, capacity_groups=100)
        buf.set_learner_version(5)
        n = 0
        while n < 20 and buf.can_start(weights_version=2):
            buf.start()
            n += 1
        assert n == (2 + 1 + 1) * 2 and max(i // 2 for i in range(n)) - 2 <= 1

    asyncio.run(main())
