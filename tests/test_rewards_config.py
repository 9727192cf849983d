"""``reward.*`` is checked in the driver before Ray starts: a bad value stops the run
with exit 2 and one line naming the key (as tests/test_startup_checks.py does for the
other components)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import refused_before_ray
from hydra import compose, initialize_config_dir

CONF = Path(__file__).parents[1] / "conf"
TASK = "_target_: asyncrl.rewards.task.TaskReward"

BAD = [
    ("reward.workers=-1", "reward.workers=-1: expected an integer in [0, 1024]"),
    ("reward.on_error=abc", "reward.on_error='abc': expected a number"),
    ("+reward.bogus=1", "reward: unknown key(s) ['bogus']"),
    ("reward.components=[]", "reward.components is empty"),
    (f"reward.components=[{{{TASK}}}]", "reward.components[0].weight=None"),
    ("reward.components=[{_target_: nope.Nope, weight: 1}]", "reward.components[0]._target_"),
    ("reward.components=[{_target_: asyncrl.tasks.arithmetic.AdditionTask, weight: 1}]",
     "not a subclass of asyncrl.rewards.base.Reward"),
    (f"reward.components=[{{{TASK}, weight: 1, model: x}}]",
     "reward.components[0]: asyncrl.rewards.task.TaskReward takes no argument(s) ['model']"),
    (f"reward.components=[{{{TASK}, weight: 1}}, {{{TASK}, weight: 2}}]",
     "reward.components[1]: name 'task' is taken by reward.components[0]"),
    ("reward.monitor.near_dup=2", "reward.monitor.near_dup=2.0: expected a number in [0, 1]"),
]  # fmt: skip


def cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize("override,names", BAD, ids=[o for o, _ in BAD])
def test_a_bad_reward_value_stops_the_run_before_ray(override, names, tmp_path, capsys,
                                                     monkeypatch):  # fmt: skip
    line = refused_before_ray(cfg(override, "progress=false"), tmp_path, capsys, monkeypatch)
    assert names in line, line


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF / "reward").glob("*.yaml")))
def test_every_shipped_reward_config_is_accepted(name):
    from asyncrl.rewards.settings import RewardSettings

    s = RewardSettings.from_config(cfg(f"reward={name}").reward)
    assert s.components and all("weight" in c for c in s.components)


def test_the_default_is_the_task_reward_alone_on_the_fast_path():
    from asyncrl.rewards.settings import RewardSettings

    s = RewardSettings.from_config(cfg().reward)
    assert s.specs() == [({"_target_": "asyncrl.rewards.task.TaskReward"}, 1.0)]
    assert s.inline and s.workers == 2
