"""The driver's half of resume: queue accounting merged into a live queue (its actors
started before the load) keeps ``produced == trained + dropped + in_queue`` and leaves
the throttle window open; task samplers continue where they were."""

from __future__ import annotations

from asyncrl.replay.buffer import GroupMeta, ReplayBuffer
from asyncrl.tasks.arithmetic import AdditionTask
from asyncrl.tasks.base import TaskSampler

BG, N = 2, 4  # groups per batch, samples per group


def produce(buf: ReplayBuffer, tag: str, k: int, version: int) -> None:
    for g in range(k):
        assert buf.can_start()
        buf.start()
        ids = [f"{tag}{g}-{i}" for i in range(N)]
        buf.put(object(), GroupMeta(f"{tag}{g}", ids, [version] * N, [5] * N, [0.0] * N))


def invariant(buf: ReplayBuffer) -> bool:
    s = buf.stats()
    return s["produced"] == s["trained"] + s["dropped_stale"] + s["in_flight"]


def test_queue_accounting_survives_resume():
    old = ReplayBuffer(max_staleness=1, batch_groups=BG, policy="throttle")
    for v, k in enumerate([2 * BG, BG, BG]):  # three steps; two groups stay queued
        produce(old, f"v{v}-", k, v)
        assert len(old.take(BG)) == BG
        old.set_learner_version(v + 1)
    old.start()  # one group generating at the checkpoint
    state = old.state_dict()
    assert invariant(old) and old.stats()["in_flight"] > 0

    new = ReplayBuffer(max_staleness=1, batch_groups=BG, policy="throttle")
    produce(new, "early-", 2, 0)  # the new run's actors got going before the load
    new.start()
    stats = new.resume_from(state)
    assert invariant(new)
    assert stats["produced"] == state["acc"]["produced"] + 2 * N
    assert stats["groups_running"] == 1 and stats["learner_version"] == 3
    # the old run keeps exactly the groups it trained in the throttle window
    a = new.acc
    assert a.groups_started - a.groups_dropped == 3 * BG + 3
    assert new.can_start()
    new.evict_stale()  # the early groups carry version 0: stale at version 3
    assert invariant(new) and new.stats()["in_flight"] == 0


def test_task_sampler_state_continues_the_stream():
    task = AdditionTask(max_operand=19)
    a = TaskSampler(task, seed=3)
    for _ in range(5):
        a.next()
    b = TaskSampler(task, seed=3)
    b.next()  # drawn before the state arrived
    b.load_state_dict(a.state_dict())
    assert [a.next().text for _ in range(4)] == [b.next().text for _ in range(4)]
