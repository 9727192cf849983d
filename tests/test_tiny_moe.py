"""``model=tiny_moe``: the tiny model's mixture-of-experts sibling (a Qwen3-MoE-style
model, asyncrl/models/tiny.py) builds offline from the preset, and a vLLM-CPU engine
running it agrees with the learner's log-probs before and after an in-place weight
update. The update is where vLLM-CPU needs asyncrl/engine/moe_reload.py: without it a
reloaded layer's experts are read in the wrong layout (max |dlogp| ~0.9).

The engine records the experts its routers chose (``actor.record_experts``,
asyncrl/engine/experts.py): the learner's own routers choose the same on every recorded
token at the same weights, and with ``learner.moe.routing_replay`` a learner whose
routers differ from the engine's routes every token as the engine did. One engine for
the module (a start costs ~25-60 s)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import torch
from helpers import (
    MOE_WARM_START_STEPS,
    composed,
    engine_actor,
    fp32_learner,
    perturbed_state,
    replayed,
)
from omegaconf import OmegaConf

from asyncrl.tasks.base import Prompt
from asyncrl.trajectory import from_bytes, to_bytes

FP32_LOGP_TOL = 2e-4  # fp32 on both sides, as tests/test_actor_vllm.py


def test_the_preset_builds_a_qwen3_moe_model(moe_model):
    from transformers import AutoConfig

    from asyncrl.models.tiny import TinyModelSpec

    cfg = composed("model=tiny_moe").model.tiny
    hf = AutoConfig.from_pretrained(moe_model)
    assert hf.model_type == "qwen3_moe"
    assert (hf.num_experts, hf.num_experts_per_tok) == (cfg.num_experts, cfg.experts_per_token)
    assert hf.moe_intermediate_size == cfg.intermediate_size and hf.head_dim >= 32
    assert hf.decoder_sparse_step == 1 and not hf.mlp_only_layers  # every layer is MoE
    meta = json.loads((Path(moe_model) / "asyncrl_build.json").read_text())
    spec = TinyModelSpec(
        **{**OmegaConf.to_container(cfg), "warm_start_steps": MOE_WARM_START_STEPS}
    )
    assert meta["spec"] == dataclasses.asdict(spec)
    assert meta["warm_start_loss_last"] < meta["warm_start_loss_first"]


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.tiny.num_experts=1", "model.tiny.num_experts=1"),
        ("model.tiny.experts_per_token=9", "model.tiny.experts_per_token=9"),
        ("model.tiny.intermediate_size=48", "model.tiny.intermediate_size=48"),
    ],
)
def test_a_moe_spec_no_engine_can_run_is_refused_naming_the_key(override, key, task, tmp_path):
    from asyncrl.config import ConfigError
    from asyncrl.models.resolve import resolve_model

    cfg = composed("model=tiny_moe", override, f"model.cache_dir={tmp_path}")
    with pytest.raises(ConfigError, match=key):
        resolve_model(cfg, task)
    assert not any(tmp_path.iterdir())  # refused before any build


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def moe_actor(moe_model, task):
    """A vLLM-CPU engine on the model, recording routed experts, at version 0."""
    from asyncrl.actor.settings import ActorSettings

    sampling = {"n": 4, "temperature": 1.0, "max_tokens": 6}
    settings = ActorSettings.defaults(update_mode="keep", sampling=sampling, record_experts=True)
    async with engine_actor(moe_model, task, settings) as actor:
        yield actor


LAYERS, TOP_K = 2, 2  # the preset's MoE layers and experts per token
ROUTER_NOISE = 0.01  # on the learner's routers only: some tokens' top-2 change


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_replay_routes_every_token_as_the_engine_did(moe_model, moe_actor):
    """Records cover every position the engine read (prompt and generated tokens but
    the last), survive the trajectory's bytes, equal the learner's own routing at the
    same weights, and a learner whose routers moved routes every token as recorded only
    with replay."""
    assert moe_actor.version == 0  # first in the module: the weights fp32_learner loads
    group = await moe_actor.episodes.run_group(Prompt("12+7=", "19"))
    ts = group.trajectories
    for t in ts:
        assert t.routed_experts.dtype == np.uint8
        assert t.routed_experts.shape == (t.num_tokens - 1, LAYERS, TOP_K)
        top = np.sort(t.routed_experts, -1)
        assert (top[..., 0] < top[..., 1]).all() and top.max() < 8  # two distinct of 8 experts
    back = from_bytes(to_bytes(ts))
    assert all((a.routed_experts == b.routed_experts).all() for a, b in zip(ts, back))
    recorded = sum(len(t.routed_experts) for t in ts) * LAYERS

    own = fp32_learner(moe_model)
    own.logprobs_of(ts)
    assert replayed(own) == (recorded, 0)  # same weights: the same experts everywhere

    moved, replay = fp32_learner(moe_model), fp32_learner(moe_model, routing_replay=True)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for ln in (moved, replay):
            for i, f in enumerate(ln.routing.forwards):
                gen.manual_seed(i)  # the same moved routers in both learners
                noise = torch.randn(f.router.weight.shape, generator=gen)
                f.router.weight.add_(ROUTER_NOISE * noise)
    moved.logprobs_of(ts)
    n, differ = replayed(moved)
    print(f"routers moved, no replay: {differ} of {n} (position, layer) pairs routed elsewhere")
    assert n == recorded and 0 < differ < n
    replay.logprobs_of(ts)
    assert replayed(replay) == (recorded, 0)  # every recorded position, every layer


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_engine_and_learner_agree_before_and_after_a_weight_update(moe_model, moe_actor):
    """One engine, one learner (fp32 both): behaviour log-probs equal the learner's at
    version 0, and again at version 1 after the learner's perturbed weights (router and
    experts included) are loaded into the running engine in place; the engine's records
    after the update are the new routers' choices."""
    learner = fp32_learner(moe_model)
    actor = moe_actor
    before = await actor.episodes.run_group(Prompt("12+7=", "19"))
    for t, lp in zip(before.trajectories, learner.logprobs_of(before.trajectories)):
        assert (t.versions == 0).all()
        np.testing.assert_allclose(t.behaviour_logprobs, lp, atol=FP32_LOGP_TOL)

    state = perturbed_state(learner, seed=1)
    assert any(".mlp.experts." in k for k in state) and any(".mlp.gate." in k for k in state)
    ref = asyncio.get_running_loop().create_future()
    ref.set_result(state)
    await actor.update_weights([ref], 1)  # the object-store path's in-place reload

    after = await actor.episodes.run_group(Prompt("3+4=", "7"))
    for t, lp in zip(after.trajectories, learner.logprobs_of(after.trajectories)):
        assert (t.versions == 1).all()
        np.testing.assert_allclose(t.behaviour_logprobs, lp, atol=FP32_LOGP_TOL)
    assert replayed(learner) == (sum(len(t.routed_experts) for t in after.trajectories) * 2, 0)
    moved = max(
        np.abs(t.behaviour_logprobs - lp).max()
        for t, lp in zip(before.trajectories, learner.logprobs_of(before.trajectories))
    )
    assert moved > 10 * FP32_LOGP_TOL, moved  # the weights really changed
