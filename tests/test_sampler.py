"""The difficulty-adaptive sampler (asyncrl/tasks/sampler.py): it draws prompts whose
groups carried no GRPO signal less often, is seeded, and a sampler restored from its
state (as a checkpoint's driver_state.json holds it) draws on exactly as the original."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from asyncrl.config import ConfigError
from asyncrl.tasks.arithmetic import AdditionTask
from asyncrl.tasks.sampler import (
    AdaptiveSampler,
    Sampled,
    SamplerKind,
    SamplerSettings,
    UniformSampler,
    make_sampler,
    with_sampler,
)

ADAPTIVE = SamplerSettings.defaults(kind=SamplerKind.ADAPTIVE)


def solved(prompt) -> bool:
    """A made-up policy: it always answers sums below 20 and never the others."""
    return sum(prompt.meta["operands"]) < 20


def group_rewards(prompt, rng: random.Random) -> list[float]:
    """Eight samples: all 1 (easy), or mixed on a third of the hard ones, else all 0."""
    if solved(prompt):
        return [1.0] * 8
    if int(prompt.answer) % 3 == 0:
        return [float(rng.random() < 0.5) for _ in range(7)] + [1.0]  # some signal
    return [0.0] * 8


def run(sampler, n: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)  # the "policy"'s own randomness
    out = []
    for _ in range(n):
        p = sampler.next()
        sampler.observe(p, group_rewards(p, rng))
        out.append(p.text)
    return out


def informative_frac(texts: list[str]) -> float:
    """Share of draws on prompts whose groups carry signal (hard sums divisible by 3)."""
    sums = [sum(int(x) for x in t.rstrip("=").split("+")) for t in texts]
    return sum(v >= 20 and v % 3 == 0 for v in sums) / len(texts)


def test_adaptive_draws_the_informative_prompts_more_often():
    task = AdditionTask(max_operand=19)
    uni, ada = UniformSampler(task, 0), AdaptiveSampler(task, 0, ADAPTIVE)
    u, a = run(uni, 3000), run(ada, 3000)
    fu, fa = informative_frac(u[1000:]), informative_frac(a[1000:])
    # the uniform stream draws them at their share of the space (~0.15); the adaptive
    # one redraws 3 of 4 draws of the zero-signal prompts once it has seen them
    assert 0.1 < fu < 0.2, fu
    assert fa > 1.5 * fu, (fu, fa)
    assert ada.skipped > 1000
    # down-weighted, not banned: the easy prompts still come up
    assert sum(solved_text(t) for t in a[1000:]) > 50


def solved_text(text: str) -> bool:
    return sum(int(x) for x in text.rstrip("=").split("+")) < 20


def test_the_uniform_sampler_is_the_tasks_own_stream():
    from asyncrl.tasks.base import TaskSampler

    task = AdditionTask(max_operand=19)
    a, b = UniformSampler(task, 3), TaskSampler(task, 3)
    assert run(a, 50) == [b.next().text for _ in range(50)]


def test_seeded():
    task = AdditionTask(max_operand=19)
    assert run(AdaptiveSampler(task, 5, ADAPTIVE), 500) == run(
        AdaptiveSampler(task, 5, ADAPTIVE), 500
    )
    assert run(AdaptiveSampler(task, 5, ADAPTIVE), 50) != run(
        AdaptiveSampler(task, 6, ADAPTIVE), 50
    )


@pytest.mark.parametrize("at", [0, 1, 137, 600])
def test_a_restored_sampler_draws_on_as_if_never_stopped(at):
    """Stop after ``at`` groups, save the state through JSON (the checkpoint's
    driver_state.json), restore into a fresh sampler of another seed, and go on: the
    same prompts as the run that never stopped, and the same state at the end."""
    task = AdditionTask(max_operand=19)
    whole = AdaptiveSampler(task, 11, ADAPTIVE)
    rng = random.Random(3)
    first = []
    for _ in range(at):
        p = whole.next()
        whole.observe(p, group_rewards(p, rng))
        first.append(p.text)
    state = json.loads(json.dumps(whole.state_dict()))
    resumed = AdaptiveSampler(task, 999, ADAPTIVE)
    resumed.load_state_dict(state)
    rng_a, rng_b = random.Random(4), random.Random(4)
    go_on = run_with(whole, 400, rng_a)
    again = run_with(resumed, 400, rng_b)
    assert go_on == again
    assert json.dumps(whole.state_dict()) == json.dumps(resumed.state_dict())


def run_with(sampler, n, rng):
    out = []
    for _ in range(n):
        p = sampler.next()
        sampler.observe(p, group_rewards(p, rng))
        out.append(p.text)
    return out


def test_memory_is_bounded_and_least_recent_goes_first():
    s = AdaptiveSampler(
        AdditionTask(max_operand=19),
        0,
        SamplerSettings.defaults(kind=SamplerKind.ADAPTIVE, max_prompts=10),
    )
    run(s, 200)
    assert len(s.recent) == 10
    assert all(len(v) <= 2 for v in s.recent.values())


def test_the_actor_builds_what_the_config_names():
    task = AdditionTask(max_operand=19)
    assert with_sampler(task, SamplerSettings.defaults()) is task
    wrapped = with_sampler(task, ADAPTIVE)
    assert isinstance(wrapped, Sampled) and wrapped.alphabet == task.alphabet
    assert isinstance(make_sampler(task, 0), UniformSampler)
    s = make_sampler(wrapped, 0)
    assert isinstance(s, AdaptiveSampler) and s.task is task and s.settings is ADAPTIVE
    import pickle

    assert pickle.loads(pickle.dumps(wrapped)).max_response_chars == task.max_response_chars


@pytest.mark.parametrize(
    "node,names",
    [({"kind": "greedy"}, "sampler.kind='greedy'"), ({"kind": "adaptive", "skip_prob": 2},
     "sampler.skip_prob=2"), ({"windows": 3}, "unknown key(s) ['windows']")],
)  # fmt: skip
def test_bad_settings_name_the_key(node, names):
    with pytest.raises(ConfigError, match=None) as e:
        SamplerSettings.defaults(**node)
    assert names in str(e.value)


def test_counter_sanity_of_the_made_up_policy():
    """The fake policy above gives the three kinds of prompt in the expected shares
    (so the first test measures the sampler, not an accident of the fake)."""
    task = AdditionTask(max_operand=19)
    r = random.Random(0)
    kinds = Counter()
    for _ in range(4000):
        p = task.sample(r)
        kinds["easy" if solved(p) else "signal" if int(p.answer) % 3 == 0 else "flat"] += 1
    assert 0.4 < kinds["easy"] / 4000 < 0.6 and 0.1 < kinds["signal"] / 4000 < 0.2


def test_the_actor_checkpoints_and_restores_its_adaptive_stream():
    """Through the rollout actor's own sampler_state / load_sampler_state (what the
    checkpoint's driver state holds): a second actor restored from the first's state
    draws the same prompts next."""
    from asyncrl.actor.rollout import RolloutActor
    from asyncrl.actor.settings import ActorSettings

    task = with_sampler(AdditionTask(max_operand=19), ADAPTIVE)
    a = RolloutActor("a", "unused", task, None, ActorSettings.defaults(), seed=1)
    b = RolloutActor("b", "unused", task, None, ActorSettings.defaults(), seed=2)
    assert isinstance(a.sampler, AdaptiveSampler)
    run(a.sampler, 300)
    b.load_sampler_state(json.loads(json.dumps(a.sampler_state())))
    assert run(a.sampler, 200, seed=9) == run(b.sampler, 200, seed=9)
    assert a.sampler.recent == b.sampler.recent and a.sampler.skipped == b.sampler.skipped > 0
