"""ReplayBuffer / ReplayQueueCore: staleness bound, group-complete batches, reuse,
backpressure and exact accounting (produced == trained + dropped + in_queue). The
hand-off and the Outbox: tests/test_replay_outbox.py."""

from __future__ import annotations

import asyncio
import random

import pytest
from replay_fakes import hand_off

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
            assert await q.hand_over(hand_off([meta("g", [0])])) == ([], 0)

        got, _ = await asyncio.gather(q.get_batch(1, 0, timeout_s=2.0), producer())
        assert [(it.ref, it.bundle_index) for it in got] == [("bundle-0", 0)]
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
