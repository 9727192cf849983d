"""The direct TP send on the tiny mixture-of-experts model with expert parallelism in the
learner (``model=tiny_moe learner.tp=2 learner.ep=2 learner.world_size=4`` and an
engine at ``tensor_parallel_size=2``): each learner TP rank of ``dp_rank`` 0 sends its own
engine shard; its experts' share (its width of every expert, learner experts split by
expert over ``ep``) comes from one all-to-all within its ``ep`` group
(asyncrl/learner/dist.py ``swap_experts``; asyncrl/transport/reshard.py
``DirectPlan.exchange``), nothing is gathered.

Slow, on the session's TP-2 engine (conftest.py ``tp_moe_actor``, shared with
tests/test_tp_moe_engine.py): a real TP2 x EP2 learner (4 Ray ranks, gloo), one vLLM-CPU
engine of 2 workers, the real gloo broker, verifying. After a full sync, a
``sparse_delta`` and a ``changed_buckets`` sync of perturbed layer-0 weights (attention,
router, experts) every worker's loaded digests equal its learner TP rank's shard digests
and the full-tensor plan's slice of the learner's gathered weights, and the engine's
behaviour log-probs match the learner's recomputation after the full one.
"""

from __future__ import annotations

import sys

import helpers
import pytest
import weight_sync_controls

TP = 2
FP32_LOGP_TOL = 2e-4  # fp32 on both sides; the row-parallel sums add in another order
PARTIAL = {  # payload mode: (the tensors moved, the fraction of their elements)
    "full": ("layers.0.", 1.0),  # attention, router and experts of layer 0
    "sparse_delta": ("layers.0.", 0.01),
    "changed_buckets": ("layers.0.mlp.experts.down_proj", 1.0),  # a few buckets, experts
}


def perturb(rank, seed: int, mode: str) -> None:
    """On a learner rank's actor: move its own shard of ``PARTIAL[mode]``'s tensors
    (the experts: its share of them), seeded per ``dp_rank`` so that a tensor the ``tp``
    ranks replicate (the router, q/k norms) moves the same on both; the sender's
    buckets made small (32 KiB) so that partial modes have buckets to skip."""
    import torch

    sender = rank.learner.weights._sender
    if sender is not None:
        sender.endpoint.bucket_mb = 1 / 32
    prefix, frac = PARTIAL[mode]
    g = torch.Generator().manual_seed(seed * 10 + rank.learner.rank // TP)
    with torch.no_grad():
        for name, p in rank.learner.model.named_parameters():
            if prefix in name and ("self_attn" in name or "mlp" in name):
                local = p.to_local() if hasattr(p, "to_local") else p
                mask = torch.rand(local.shape, generator=g) < frac
                local.add_(0.05 * torch.randn(local.shape, generator=g) * mask)


@pytest.fixture(scope="module")
def moe_ep_world(ray_local, tp_moe_actor, moe_model):
    """A TP2 x EP2 learner (4 ranks) and the gloo broker (verify) on the session's TP-2
    engine of the tiny MoE model."""
    from ray import cloudpickle

    from asyncrl.config import compose_config

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cloudpickle.register_pickle_by_value(helpers)
    cloudpickle.register_pickle_by_value(weight_sync_controls)
    cfg = compose_config(["model=tiny_moe", "learner.tp=2", "learner.ep=2",
                          "learner.world_size=4", "learner.num_cpus=0.25"])  # fmt: skip
    actor, sampling = tp_moe_actor["actor"], tp_moe_actor["sampling"]
    with helpers.learner_world(ray_local, cfg, str(moe_model), sampling, actor,
                               120.0, 300.0) as w:  # fmt: skip
        yield w


def synced(ray, w, version: int, model_dir, mode: str) -> dict[str, float]:
    """Perturb every learner rank, publish ``version``: every worker loaded exactly its
    learner TP rank's shard, which is the full-tensor plan's slice; the experts were
    exchanged, nothing gathered."""
    m, loaded, by_rank = helpers.publish_tp_sync(ray, w, version, mode, perturb, TP, model_dir)
    assert [x["digests"] for x in loaded] == [x["digests"] for x in by_rank[:TP]]
    assert [x["digests"] for x in by_rank[TP:]] == [x["digests"] for x in by_rank[:TP]]
    assert all(x["gathered"] == [] and len(x["exchanged"]) == 4 for x in by_rank)
    return m


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_ep_learners_tp_ranks_feed_a_tp2_moe_engine_bit_exact_in_every_mode(
    ray_local, moe_ep_world, moe_model
):
    import numpy as np
    from helpers import collect_at
    from weight_sync_controls import set_policy

    ray, w = ray_local, moe_ep_world
    learner = w["learner"]
    assert ray.get(w["actor"].weight_state.remote()).workers == TP
    full = synced(ray, w, 1, moe_model, "full")  # the broker's mode: full
    sent, per_learner = full["broker/bytes_sent"], full["broker/bytes_per_learner_rank"]
    assert 0.45 < per_learner / sent < 0.55, full  # each TP rank sent its half
    trajs = collect_at(ray, w["queue"], 1)
    diff = max(
        float(np.abs(t.behaviour_logprobs - lp).max())
        for t, lp in zip(trajs, learner.logprobs_of(trajs), strict=True)
    )
    assert diff < FP32_LOGP_TOL
    figures = [f"full: {sent:.0f} B sent, {per_learner:.0f} B per learner rank, "
               f"{full['broker/bytes_per_engine_rank']:.0f} B per engine rank, "
               f"{full['broker/sync_seconds']:.3f} s, max |dlogp| {diff:.1e}"]  # fmt: skip
    for version, mode in ((2, "sparse_delta"), (3, "changed_buckets")):
        set_policy(w["broker"], mode)
        m = synced(ray, w, version, moe_model, mode)
        assert m["broker/bytes_sent"] < 0.5 * sent, (mode, m)  # a partial sync, per shard
        assert m["broker/buckets_sparse"] + m["broker/buckets_skipped"] > 0, (mode, m)
        figures.append(f"{mode}: {m['broker/bytes_sent']:.0f} B sent, "
                       f"{m['broker/bytes_per_learner_rank']:.0f} B per learner rank, "
                       f"{m['broker/sync_seconds']:.3f} s")  # fmt: skip
    print("; ".join(figures))
