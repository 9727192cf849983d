"""Engine shards cut by a tensor-parallel learner's own ranks (``learner.tp`` = the
engine's TP size): asyncrl/transport/reshard.py ``direct_plan``, asyncrl/learner/dist.py
``tp_layout`` / ``stream_local``, asyncrl/learner/weights.py ``engine_shard``.

Fast: the per-tensor check against the full-tensor plan, on tensors split as the
learner splits them (torch.chunk over ``tp``), for the tiny Qwen2 at T = 2 and a Llama
layout at T = 3 and 6 (key/value heads the engine replicates, which a learner shard
cannot serve: gathered). Slow: a real TP2 learner (two Ray ranks, gloo), each rank's
shard against the full-tensor plan's slice of rank 0's gathered weights, bit for bit,
and what each rank held to cut it.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
from test_reshard import LLAMA, MOE, TINY, hf_tensors, moe_tensors

from asyncrl.transport.endpoint import digests
from asyncrl.transport.reshard import (
    EXPERTS_EP,
    OTHER,
    UnsupportedLayout,
    direct_plan,
    direct_senders,
    plan_for,
)

COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # the learner splits rows
ROWWISE = ("o_proj.weight", "down_proj.weight")  # the learner splits columns


def learner_split(name: str) -> int | None:
    """How the learner's TP plan (colwise / rowwise, the rest replicated) holds ``name``."""
    if any(f".{p}." in name for p in COLWISE):
        return 0
    return 1 if name.endswith(ROWWISE) else None


def held_by(full: dict[str, torch.Tensor], tp: int, rank: int, gather=()) -> dict:
    """What learner TP rank ``rank`` holds: its chunk of a split tensor, else the whole."""
    out = {}
    for n, t in full.items():
        d = learner_split(n)
        out[n] = t if d is None or n in gather else torch.chunk(t, tp, d)[rank]
    return out


@pytest.mark.parametrize(("config", "tp", "gathered"), [
    (json.loads(TINY.read_text()), 2, set()),
    (LLAMA, 3, set()),
    (LLAMA, 6, {"model.layers.0.self_attn.k_proj.weight",
                "model.layers.0.self_attn.v_proj.weight"}),
])  # fmt: skip
def test_each_learner_rank_cuts_exactly_the_engine_shard(config, tp, gathered):
    full = hf_tensors(config, layers=1, seed=tp)
    layout = [(n, tuple(t.shape), learner_split(n)) for n, t in full.items()]
    direct = direct_plan(config, layout, tp)
    assert direct.gather == gathered  # k/v: the engine's replicated head crosses a chunk
    assert direct_plan(config, layout, tp) is direct  # once per pair of layouts
    plan = plan_for(config, [(n, s) for n, s, _ in layout], tp)
    for r in range(tp):
        want = dict(plan.shard(r, full))
        got = dict(direct.shard(r, held_by(full, tp, r, direct.gather)))
        assert list(got) == list(want)  # the same names in the same order: the same pack
        assert all(torch.equal(got[n], want[n]) for n in want), r


@pytest.mark.parametrize(("config", "tp", "learner_tp"), [
    (json.loads(TINY.read_text()), 2, 1),  # plain FSDP: every tensor whole once unsharded
    (LLAMA, 6, 1),
    (LLAMA, 6, 3),  # each learner part: two engine ranks' heads and their key/value head
])  # fmt: skip
def test_a_learner_at_a_smaller_tp_cuts_the_engine_shards_its_part_holds(config, tp, learner_tp):
    full = hf_tensors(config, layers=1, seed=tp + learner_tp)
    layout = [(n, tuple(t.shape), learner_split(n) if learner_tp > 1 else None)
              for n, t in full.items()]  # fmt: skip
    direct = direct_plan(config, layout, tp, learner_tp)
    assert direct.gather == set() and direct.exchange == {}
    plan = plan_for(config, [(n, s) for n, s, _ in layout], tp)
    for t in range(tp):
        assert direct.part(t) == t // (tp // learner_tp)
        held = held_by(full, learner_tp, direct.part(t))
        assert digests(direct.shard(t, held)) == digests(plan.shard(t, full)), t


def test_the_senders_are_ranks_whose_part_holds_their_engine_shard():
    """``direct_senders``: engine rank t's sender is a rank of the TP rank whose part holds
    t's slices, each rank sends at most one shard, and too few ranks (or engine ranks
    straddling learner parts) leave the gather path."""
    cases = {(2, 1, 2): (0, 1), (4, 1, 2): (0, 1), (4, 2, 2): (0, 1), (4, 2, 4): (0, 2, 1, 3),
             (8, 2, 4): (0, 2, 1, 3), (6, 3, 6): (0, 3, 1, 4, 2, 5)}  # fmt: skip
    for (world, ltp, etp), want in cases.items():
        got = direct_senders(world, ltp, etp)
        assert got == want and len(set(got)) == etp
        assert all(r % ltp == t // (etp // ltp) for t, r in enumerate(got))  # its part
    for (world, ltp, etp), why in {
        (1, 1, 2): "1 learner rank",
        (2, 2, 4): "cannot send 4 engine shards",
        (4, 4, 2): "not a multiple of learner.tp=4",
        (2, 1, 1): "the engines hold whole tensors",
    }.items():
        with pytest.raises(UnsupportedLayout, match=why):
            direct_senders(world, ltp, etp)


def test_tensors_split_otherwise_are_gathered():
    """Another split dimension than the engine's, or a layout the learner cannot state
    (``OTHER``): those tensors are gathered; the rest still comes from the rank's shard."""
    config = json.loads(TINY.read_text())
    full = hf_tensors(config, layers=1)
    o, q = "model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.q_proj.weight"
    layout = [(n, tuple(t.shape), learner_split(n)) for n, t in full.items()]
    layout = [(n, s, 0 if n == o else OTHER if n == q else d) for n, s, d in layout]
    direct = direct_plan(config, layout, 2)
    assert direct.gather == {o, q}
    plan = plan_for(config, [(n, s) for n, s, _ in layout], 2)
    for r in range(2):
        held = held_by(full, 2, r, direct.gather)
        assert digests(direct.shard(r, held)) == digests(plan.shard(r, full))


def swapped(full: torch.Tensor, pieces, ep: int, rank: int) -> torch.Tensor:
    """What ``dist.swap_experts`` leaves on a rank of TP rank ``rank``: each of the
    ``ep`` peers' experts (``torch.chunk`` over dim 0), cut to ``pieces[rank]``, stacked
    in peer order."""

    def cut(mine):
        return torch.cat([mine.narrow(p.dim, p.start, p.length) for p in pieces[rank]],
                         dim=pieces[rank][0].dim)  # fmt: skip

    return torch.cat([cut(mine) for mine in torch.chunk(full, ep, 0)])


@pytest.mark.parametrize("ep", [2, 4])
def test_experts_split_over_ep_are_exchanged_not_gathered(ep):
    """tiny_moe's layout at learner.tp = 2 with its experts ``Shard(0)`` over ``ep``
    (attention split as the learner splits it): nothing is gathered; each rank's expert
    pieces, swapped within its ``ep`` group, give exactly the full-tensor plan's shard,
    and hold 1/tp of the experts, not all of them."""
    tp = 2
    full = moe_tensors(MOE)
    experts = {n for n in full if ".mlp.experts." in n}
    layout = [(n, tuple(t.shape), EXPERTS_EP if n in experts else learner_split(n))
              for n, t in full.items()]  # fmt: skip
    direct = direct_plan(MOE, layout, tp)
    assert direct.gather == set() and set(direct.exchange) == experts
    plan = plan_for(MOE, [(n, s) for n, s, _ in layout], tp)
    for r in range(tp):
        held = held_by(full, tp, r)
        held.update({n: swapped(full[n], direct.exchange[n], ep, r) for n in experts})
        assert all(held[n].numel() * tp == full[n].numel() for n in experts)
        assert digests(direct.shard(r, held)) == digests(plan.shard(r, full)), r


def test_experts_over_ep_at_another_learner_tp_are_gathered():
    """An ``ep`` learner without TP (``learner.tp`` 1) under a TP-2 engine: the swap
    assumes ``ep`` groups of whole TP groups of the engine's size, so its expert tensors
    are gathered whole, and every shard is still the full-tensor plan's."""
    full = moe_tensors(MOE)
    experts = {n for n in full if ".mlp.experts." in n}
    layout = [(n, tuple(t.shape), EXPERTS_EP if n in experts else None) for n, t in full.items()]
    direct = direct_plan(MOE, layout, 2, learner_tp=1)
    assert direct.gather == experts and direct.exchange == {}
    plan = plan_for(MOE, [(n, s) for n, s, _ in layout], 2)
    for t in range(2):
        assert digests(direct.shard(t, full)) == digests(plan.shard(t, full)), t


# ----------------------------------------------------------------- a real TP2 learner
@pytest.mark.slow
def test_each_tp_rank_of_a_learner_cuts_its_engine_shard_bit_exact(ray_local, tmp_path):
    """TP2 x FSDP2 learner (world 4, gloo): rank r's engine shard (TP rank r % 2), cut
    from its own TP shards after FSDP's unshard, equals the full-tensor plan's slice of
    the gathered weights bit for bit; no tensor gathered, and no rank holds more than
    about half the model. The same under an engine at TP 4: rank r cuts the engine
    shard ``direct_senders`` gives it, from its own TP part."""
    import ray
    from helpers import plain_optim

    from asyncrl.learner.config import LearnerSettings
    from asyncrl.learner.group import LearnerGroup
    from asyncrl.learner.learner import Learner  # noqa: F401 - the ranks' class
    from asyncrl.losses.advantages import GroupNormalized
    from asyncrl.losses.clipped import ClippedISLoss
    from asyncrl.models.tiny import random_qwen2

    torch.set_num_threads(1)
    random_qwen2(130, 64, 2, 4, 4, 96, tie=True, out_dir=tmp_path, pad_token_id=0)
    config = json.loads((tmp_path / "config.json").read_text())
    s = LearnerSettings.defaults(optim=plain_optim(lr=1e-3), num_threads=1, world_size=4, tp=2)
    group = LearnerGroup(str(tmp_path), ClippedISLoss(), GroupNormalized(), s)
    senders = direct_senders(4, 2, 4)  # an engine at TP 4: two engine shards per TP part
    try:
        full = group.full_state_dict()  # what rank 0 gathers for the full-tensor plan
        got = ray.get([r.shard_digests.remote(2) for r in group.ranks], timeout=300)
        got4 = ray.get([r.shard_digests.remote(4, senders.index(rank))
                        for rank, r in enumerate(group.ranks)], timeout=300)  # fmt: skip
    finally:
        group.close()
    model_bytes = sum(t.numel() * t.element_size() for t in full.values())
    for tp, answers in ((2, got), (4, got4)):
        plan = plan_for(config, [(n, tuple(t.shape)) for n, t in full.items()], tp)
        for rank, g in enumerate(answers):
            t = rank % 2 if tp == 2 else senders.index(rank)  # rank = dp_rank * 2 + tp_rank
            assert g["tp_rank"] == rank % 2 and g["index"] == t and g["gathered"] == []
            assert g["digests"] == digests(plan.shard(t, full)), (tp, rank)
            assert g["nbytes"] == sum(x.numel() * x.element_size() for _, x in plan.shard(t, full))
            assert g["held_bytes"] < 0.6 * model_bytes, (g["held_bytes"], model_bytes)
    print(
        f"model {model_bytes} B; per rank at engine TP 2: held",
        [g["held_bytes"] for g in got],
        "shard",
        [g["nbytes"] for g in got],
        "; at engine TP 4:",
        [g["nbytes"] for g in got4],
    )


@pytest.mark.slow
@pytest.mark.parametrize("ep", [2, 4])
def test_each_tp_rank_of_an_ep_learner_cuts_its_engine_shard_bit_exact(ray_local, tmp_path, ep):
    """TP2 x EP learner on tiny_moe's architecture (world 4, gloo; ``ep`` 2: the experts
    ``Shard(0)`` over each ``tp`` pair, FSDP over ``dp``; ``ep`` 4: over all four ranks,
    two ``tp`` pairs in one ``ep`` group): rank r's engine shard (TP rank r % 2) equals
    the full-tensor plan's slice of the gathered weights bit for bit, the experts
    exchanged within the ``ep`` group, nothing gathered, and no rank holds more than
    about half the model."""
    import ray
    from helpers import plain_optim

    from asyncrl.learner.config import LearnerSettings
    from asyncrl.learner.group import LearnerGroup
    from asyncrl.learner.learner import Learner  # noqa: F401 - the ranks' class
    from asyncrl.losses.advantages import GroupNormalized
    from asyncrl.losses.clipped import ClippedISLoss
    from asyncrl.models.tiny import random_qwen3_moe

    torch.set_num_threads(1)
    random_qwen3_moe(20, 128, 2, 4, 2, 64, 8, 2, tie=True, out_dir=tmp_path, pad_token_id=0)
    config = json.loads((tmp_path / "config.json").read_text())
    s = LearnerSettings.defaults(optim=plain_optim(lr=1e-3), num_threads=1, world_size=4,
                                 tp=2, ep=ep)  # fmt: skip
    group = LearnerGroup(str(tmp_path), ClippedISLoss(), GroupNormalized(), s)
    try:
        full = group.full_state_dict()
        got = ray.get([r.shard_digests.remote(2) for r in group.ranks], timeout=300)
    finally:
        group.close()
    plan = plan_for(config, [(n, tuple(t.shape)) for n, t in full.items()], 2)
    experts = sorted(n for n in full if ".mlp.experts." in n)
    model_bytes = sum(t.numel() * t.element_size() for t in full.values())
    for rank, g in enumerate(got):
        r = rank % 2
        assert g["tp_rank"] == r and g["gathered"] == [] and g["exchanged"] == experts
        assert g["digests"] == digests(plan.shard(r, full)), rank
        assert g["held_bytes"] < 0.6 * model_bytes, (g["held_bytes"], model_bytes)
    print(f"ep {ep}: model {model_bytes} B; per TP rank: held", [g["held_bytes"] for g in got],
          "shard", [g["nbytes"] for g in got])  # fmt: skip


# ----------------------------------------------------------------- the transport
HOST = "127.0.0.1"
ENGINES, TP = 2, 2


def test_each_learner_tp_rank_sends_its_own_shard_in_every_mode():
    """Two learner TP ranks (group ranks 0, 1) and two engines of TP 2 (ranks 2..5),
    threads over gloo. Versions 0 (full) -> 1 (sparse) -> 2 (changed buckets) -> 3 (a
    rank's layout changed: every shard full). Each rank's shadows hold only its shard,
    every tensor bit for bit as rank 0's full-tensor path cuts it; every worker ends
    each sync holding exactly the plan's slice of that version."""
    from asyncrl.transport.endpoint import ReceiverEndpoint, SenderEndpoint
    from asyncrl.transport.spec import NO_VERSION, JoinSpec

    config = json.loads(TINY.read_text())
    v0 = hf_tensors(config, layers=2)
    v1 = {n: t.clone() for n, t in v0.items()}
    v1["model.layers.0.self_attn.q_proj.weight"][5, :3] += 1.0  # rank 0's rows
    v1["model.layers.1.mlp.down_proj.weight"][:, 300] -= 1.0  # rank 1's columns
    v2 = {n: t.clone() for n, t in v1.items()}
    v2["model.norm.weight"][0] = 3.0
    versions = [v0, v1, v2, v2]
    layout = [(n, tuple(t.shape), learner_split(n)) for n, t in v0.items()]
    direct = direct_plan(config, layout, TP)
    world, timeout_s = TP + ENGINES * TP, 30.0
    txs = [SenderEndpoint(HOST, "gloo", timeout_s, 60.0, bucket_mb=0.05) for _ in range(TP)]
    gathering = SenderEndpoint(HOST, "gloo", timeout_s, 60.0, bucket_mb=0.05, model_config=config)
    port: list[int] = []
    opened = threading.Thread(target=txs[0].open, args=("g", world, port.append, TP))
    opened.start()
    while not port:
        threading.Event().wait(0.01)
    joined = threading.Thread(target=txs[1].join_tp, args=("g", HOST, port[0], 1, world, TP))
    joined.start()
    got: dict[int, list] = {g: [] for g in range(TP, world)}

    def worker(g: int) -> None:
        rx = ReceiverEndpoint()
        spec = JoinSpec("g", HOST, port[0], g, world, timeout_s, 60.0, "gloo")
        for _ in versions:
            held: list = []
            keep = lambda t, held=held: held.append({n: x.clone() for n, x in t})  # noqa: E731
            fail = lambda t: pytest.fail("full tensors where a shard was due")  # noqa: E731
            report = rx.sync(spec, load=fail, load_shard=keep)
            got[g].append((report, held[0] if held else None))

    workers = [threading.Thread(target=worker, args=(g,), daemon=True) for g in got]
    for t in workers:
        t.start()
    opened.join(60.0)
    joined.join(60.0)
    stats: list[list] = []
    modes = ["full", "sparse_delta", "changed_buckets", "sparse_delta"]
    for v, (tensors, mode) in enumerate(zip(versions, modes, strict=True)):
        if v == 3:
            txs[1].bucket_mb = 0.03  # rank 1's shard in another bucket layout: no base
        for r, tx in enumerate(txs):
            held = held_by(tensors, TP, r, direct.gather)
            tx.snapshot(v, direct.shard(r, held), transient=False)
        gathering.snapshot(v, list(tensors.items()), transient=False)
        out: list = [None] * TP

        def send(r: int, v=v, mode=mode, out=out) -> None:
            out[r] = txs[r].send_own("g", v, v - 1 if v else NO_VERSION, mode)

        senders = [threading.Thread(target=send, args=(r,)) for r in range(TP)]
        for t in senders:
            t.start()
        for t in senders:
            t.join(120.0)
        stats.append(out)
    for t in workers:
        t.join(60.0)
    for tx in txs:
        tx.close_all()

    model_bytes = sum(t.numel() * t.element_size() for t in v0.values())
    for v in range(3):  # what the full-tensor path packs, tensor for tensor, bit for bit
        for r, want in enumerate(gathering.shard_packs(v, TP)):
            own = txs[r].shadows.get(v)
            assert digests(own.named_tensors()) == digests(want.named_tensors())
    for tx in txs:  # no learner rank holds the model: its own shard per version
        assert tx.shadows.nbytes() < 0.6 * len(tx.shadows.versions()) * model_bytes
    plan = plan_for(config, [(n, s) for n, s, _ in layout], TP)
    for g, syncs in got.items():
        rank = (g - TP) % TP
        for v, (report, held) in enumerate(syncs):
            assert report.ok, report.error
            want = dict(plan.shard(rank, versions[v]))
            assert held.keys() == want.keys()
            assert all(torch.equal(held[n], want[n]) for n in want), (g, v)
    assert [s[0].mode for s in stats] == ["full", "sparse_delta", "changed_buckets", "full"]
    full, sparse, changed, switched = (s[0] for s in stats)
    shard_bytes = [sum(t.numel() * 4 for _, t in plan.shard(r, v0)) for r in range(TP)]
    assert full.bytes_per_learner_rank == [
        ENGINES * shard_bytes[0] + full.header_bytes,
        ENGINES * shard_bytes[1],
    ]  # each rank sends its own shard once per engine, nothing else
    assert full.bytes_per_rank == full.header_bytes + max(shard_bytes)
    assert full.bytes_per_rank < 0.6 * model_bytes
    assert [s[1].bytes_per_learner_rank for s in stats][0] == [ENGINES * shard_bytes[1]]
    assert sparse.buckets_sparse > 0 and sparse.bytes_per_rank < full.bytes_per_rank / 10
    assert min(sparse.bytes_per_learner_rank) > 0  # both ranks had a change to send
    assert changed.buckets_skipped > 0 and changed.bytes_per_rank < full.bytes_per_rank
    assert switched.bytes_per_rank > 0.4 * model_bytes  # full again, every shard
    print(
        f"model {model_bytes} B; full: per learner rank {full.bytes_per_learner_rank}, "
        f"per engine rank {full.bytes_per_rank}, {full.seconds:.3f} s; sparse: "
        f"{sparse.bytes_per_learner_rank} / {sparse.bytes_per_rank}; changed: "
        f"{changed.bytes_per_learner_rank} / {changed.bytes_per_rank}"
    )


def test_a_silent_learner_rank_fails_the_sync_on_every_rank_without_a_hang():
    """Learner TP rank 1 never sends: rank 0 names it within the group's timeout (and
    posts an aborted header); the workers fail at the header (that abort, or their own
    timeout waiting for it) instead of waiting for payloads."""
    from asyncrl.transport.endpoint import ReceiverEndpoint, SenderEndpoint
    from asyncrl.transport.group import TransferError
    from asyncrl.transport.spec import HEADER_BUCKET, NO_VERSION, JoinSpec

    config = json.loads(TINY.read_text())
    v0 = hf_tensors(config, layers=1)
    layout = [(n, tuple(t.shape), learner_split(n)) for n, t in v0.items()]
    direct = direct_plan(config, layout, TP)
    world, timeout_s = TP + TP, 3.0
    txs = [SenderEndpoint(HOST, "gloo", timeout_s, 60.0, bucket_mb=0.05) for _ in range(TP)]
    port: list[int] = []
    opened = threading.Thread(target=txs[0].open, args=("g", world, port.append, TP))
    opened.start()
    while not port:
        threading.Event().wait(0.01)
    threading.Thread(target=txs[1].join_tp, args=("g", HOST, port[0], 1, world, TP)).start()
    reports: dict[int, object] = {}

    def worker(g: int) -> None:
        spec = JoinSpec("g", HOST, port[0], g, world, timeout_s, 60.0, "gloo")
        reports[g] = ReceiverEndpoint().sync(spec, load=list, load_shard=list)

    workers = [threading.Thread(target=worker, args=(g,)) for g in range(TP, world)]
    for t in workers:
        t.start()
    opened.join(60.0)
    txs[0].snapshot(0, direct.shard(0, held_by(v0, TP, 0)), transient=False)
    with pytest.raises(TransferError, match=r"sender\(s\) of engine shard\(s\) \[1\]") as e:
        txs[0].send_own("g", 0, NO_VERSION, "full")
    for t in workers:
        t.join(30.0)
    for tx in txs:
        tx.close_all()
    assert tuple(e.value.peer_ranks) == (1,)
    assert sorted(reports) == [2, 3]  # both answered: each failed at the header, no payload
    assert all(not r.ok and r.bucket == HEADER_BUCKET for r in reports.values()), reports
