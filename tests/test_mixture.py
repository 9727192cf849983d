"""Weighted task mixtures (asyncrl/tasks/mixture.py): drawn by weight, scored by the
task that made the prompt, and ``reward/task/<name>`` each task's own mean."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir

from asyncrl.config import ConfigError, build
from asyncrl.tasks.mixture import MixtureTask

CONF = Path(__file__).parents[1] / "conf"


def mixture():
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(
            "config",
            overrides=["task=mixture", "task.tasks.add19.weight=3", "task.tasks.add3ops.weight=1"],
        )
    return build("task", cfg.task)


def test_the_shipped_mixture_builds_and_draws_by_weight():
    m = mixture()
    assert m.names == ["add19", "add3ops"] and m.weights == [0.75, 0.25]
    rng = random.Random(0)
    ps = [m.sample(rng) for _ in range(4000)]
    share = sum(p.meta["task"] == "add19" for p in ps) / len(ps)
    assert 0.72 < share < 0.78, share
    three = [p for p in ps if p.meta["task"] == "add3ops"]
    assert all(p.text.count("+") == 2 and len(p.meta["operands"]) == 3 for p in three)
    assert m.alphabet == "0123456789+=" and m.max_response_chars == 2


def test_each_prompt_is_scored_by_its_own_task_and_named():
    m = mixture()
    rng = random.Random(1)
    p = next(p for p in iter(lambda: m.sample(rng), None) if p.meta["task"] == "add3ops")
    right = m.reward(p, p.answer)
    wrong = m.reward(p, "0" if p.answer != "0" else "1")
    assert right["reward"] == 1.0 and right["task/add3ops"] == 1.0 and right["exact"] == 1.0
    assert wrong["reward"] == 0.0 and wrong["task/add3ops"] == 0.0
    assert "task/add19" not in right


def test_reward_per_task_is_each_tasks_own_mean():
    """The learner's step metrics: reward/task/<name> over that task's trajectories
    (not diluted by the other task's zeros), reward/exact over all."""
    from asyncrl.learner.metrics import trajectory_metrics

    def t(reward, task, gid):
        return SimpleNamespace(
            reward=reward, min_version=0, response_len=2, group_id=gid, error="",
            finish_reason="stop", mask_tokens=2, num_tokens=6, episode={},
            reward_breakdown={"exact": reward, f"task/{task}": reward},
        )  # fmt: skip

    trajs = [t(1.0, "a", "g1"), t(1.0, "a", "g1"), t(0.0, "b", "g2"), t(1.0, "b", "g2"),
             t(0.0, "b", "g3"), t(0.0, "b", "g3")]  # fmt: skip
    m = trajectory_metrics(trajs, 0)
    assert m["reward/task/a"] == 1.0
    assert m["reward/task/b"] == 0.25
    assert m["reward/exact"] == pytest.approx(0.5)  # the other breakdown keys: over all


def test_the_tiny_model_cache_tells_mixtures_apart():
    from asyncrl.models.tiny import _task_key

    a = mixture()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        b = build("task", compose("config", overrides=["task=mixture"]).task)
    assert _task_key(a) != _task_key(b)


@pytest.mark.parametrize(
    "override,names",
    [("task.tasks.add19.weight=0", "task.tasks.add19.weight=0"),
     ("+task.tasks.add19.extra=1", "expected exactly {weight: W, task:")],
)  # fmt: skip
def test_a_bad_mixture_names_the_key(override, names):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose("config", overrides=["task=mixture", override])
    with pytest.raises(ConfigError) as e:
        build("task", cfg.task)
    assert names in str(e.value)


def test_an_empty_mixture_is_refused():
    with pytest.raises(ValueError, match="task.tasks is empty"):
        MixtureTask({})
