"""A tensor-parallel engine (``actor.engine.tensor_parallel_size=2``) on the tiny
mixture-of-experts model (``model=tiny_moe``, Qwen3-MoE style) with a resharded weight
sync (``broker.reshard``; asyncrl/transport/reshard.py).

On the session's TP-2 engine (conftest.py ``tp_moe_actor``, shared with
tests/test_tp_moe_broker.py): a RolloutActor whose engine runs two workers, the real
learner and the real gloo broker, verifying. After an in-place resharded sync of perturbed layer-0
weights (attention, router and experts), each worker loaded exactly the resharding
plan's slice of the learner's tensors (the experts' fused gate/up and down cut along
each expert's width, as vLLM's fused-MoE loader cuts them) and the engine's behaviour
log-probs match the learner's recomputation. Then a resharded sync and a full-tensor
sync of the same weights leave every worker parameter identical, bit for bit (the
experts as vLLM-CPU repacks them for its grouped GEMM), with about half the bytes per
engine rank.
"""

from __future__ import annotations

import json
import sys

import helpers
import numpy as np
import pytest
import weight_sync_controls
from helpers import collect_at, learner_world
from weight_sync_controls import set_reshard

TP = 2
FP32_LOGP_TOL = 2e-4  # fp32 on both sides; the row-parallel sums add in another order


def perturb_layer0(rank, seed: int, scale: float) -> None:
    """Move layer 0's attention and MoE weights (q/k/v, o, q/k norms, the router, the
    experts' fused gate/up and down); run on a learner rank's Ray actor."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in rank.learner.model.named_parameters():
            if "layers.0." in name and ("self_attn" in name or "mlp" in name):
                p.add_(scale * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def tp_world(ray_local, tp_moe_actor, moe_model):
    """A one-rank learner and the gloo broker (resharding) on the session's TP-2 engine."""
    from ray import cloudpickle

    from asyncrl.config import compose_config

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cloudpickle.register_pickle_by_value(helpers)
    cloudpickle.register_pickle_by_value(weight_sync_controls)  # set_reshard's function
    cfg = compose_config(["model=tiny_moe"])
    actor, sampling = tp_moe_actor["actor"], tp_moe_actor["sampling"]
    with learner_world(ray_local, cfg, str(moe_model), sampling, actor, 120.0, 300.0) as world:
        yield world


def shard_digests(model_dir, hf: dict) -> list[dict[str, str]]:
    """Per engine TP rank, the digests of the resharding plan's slice of ``hf``."""
    from pathlib import Path

    from asyncrl.transport.endpoint import digests
    from asyncrl.transport.reshard import plan_for

    config = json.loads((Path(model_dir) / "config.json").read_text())
    plan = plan_for(config, [(k, tuple(v.shape)) for k, v in hf.items()], TP)
    return [digests(plan.shard(r, hf)) for r in range(TP)]


def max_dlogp(learner, trajs: list) -> float:
    recomputed = learner.logprobs_of(trajs)
    return max(
        float(np.abs(t.behaviour_logprobs - lp).max())
        for t, lp in zip(trajs, recomputed, strict=True)
    )


@pytest.mark.slow
def test_a_tp2_moe_engine_loads_its_shards_and_samples_as_the_learner(
    ray_local, tp_world, moe_model
):
    ray = ray_local
    w = tp_world
    actor, learner, broker = w["actor"], w["learner"], w["broker"]
    assert ray.get(actor.weight_state.remote()).workers == TP
    before = collect_at(ray, w["queue"], 0)
    assert max_dlogp(learner, before) < FP32_LOGP_TOL

    ray.get(learner.ranks[0].__ray_call__.remote(perturb_layer0, 1, 0.05))
    assert max_dlogp(learner, before) > 0.01  # the learner moved: the check has teeth
    broker.publish(1)
    m = broker.wait()
    assert m["broker/errors"] == 0, broker.errors
    assert broker.actor_versions == {"actor0": 1}
    loaded = ray.get(actor.loaded_digests.remote())
    shards = shard_digests(moe_model, learner.full_state_dict())
    assert len(loaded) == TP and [x["digests"] for x in loaded] == shards
    assert all(x["version"] == 1 for x in loaded)
    experts = [n for n in shards[0] if ".experts.routed_experts." in n]
    assert len(experts) == 2 * 2  # w13 and w2 of both MoE layers
    after = collect_at(ray, w["queue"], 1)
    diff = max_dlogp(learner, after)
    print(f"TP{TP} MoE: after a resharded sync max |dlogp| {diff:.2e}, "
          f"sync {m.get('broker/sync_seconds', float('nan')):.3f} s")  # fmt: skip
    assert diff < FP32_LOGP_TOL


@pytest.mark.slow
def test_a_resharded_moe_sync_leaves_the_workers_as_a_full_tensor_sync_does(ray_local, tp_world):
    ray = ray_local
    w = tp_world
    actor, learner, broker = w["actor"], w["learner"], w["broker"]
    ray.get(learner.ranks[0].__ray_call__.remote(perturb_layer0, 2, 0.05))
    broker.publish(2)  # resharded: each worker receives its shard
    resharded = broker.wait()
    after_shards = ray.get(actor.worker_params.remote())
    set_reshard(broker, False)
    try:
        broker.publish(3)  # the same weights, every worker gets the full tensors
        full = broker.wait()
    finally:
        set_reshard(broker, True)
    after_full = ray.get(actor.worker_params.remote())
    assert resharded["broker/errors"] == 0 and full["broker/errors"] == 0, broker.errors
    assert broker.actor_versions == {"actor0": 3}
    by_rank = {x["rank"]: x["params"] for x in after_full}
    n, experts = 0, 0
    for x in after_shards:
        assert x["params"].keys() == by_rank[x["rank"]].keys()
        for name, got in x["params"].items():
            assert got == by_rank[x["rank"]][name], (x["rank"], name)  # dtype, shape, bytes
            n += 1
            experts += ".experts." in name
    assert experts >= TP * 2 * 2  # both ranks' w13 and w2 of both MoE layers
    per_rank = resharded["broker/bytes_per_engine_rank"], full["broker/bytes_per_engine_rank"]
    print(f"TP{TP} MoE: {n} worker parameters identical after a resharded and a full sync; "
          f"bytes per engine rank {per_rank[0]:.0f} vs {per_rank[1]:.0f}, sync "
          f"{resharded['broker/sync_seconds']:.3f} s vs {full['broker/sync_seconds']:.3f} s")  # fmt: skip
    assert 0.4 < per_rank[0] / per_rank[1] < 0.6
