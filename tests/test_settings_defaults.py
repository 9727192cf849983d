"""One source of every default: conf/. Settings built in Python (``X.defaults()``, what
tests, benchmarks and notebooks use) equal the ones ``asyncrl-train`` runs with, and no
settings dataclass carries a default of its own that could drift from conf/."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from asyncrl.actor.settings import ActorSettings
from asyncrl.broker.settings import BrokerSettings
from asyncrl.config import ConfigError, Range, Settings, compose_config, defaults
from asyncrl.eval.settings import EvalSetSettings
from asyncrl.learner.config import LearnerSettings, OptimSettings
from asyncrl.losses.clipped import ClippedISLoss

ROOT = Path(__file__).parents[1]


def all_settings() -> list[type]:
    """Every settings dataclass (each module imported: they register by subclassing)."""
    import asyncrl.envs.settings
    import asyncrl.eval.settings
    import asyncrl.fault.settings
    import asyncrl.models.tiny_vlm
    import asyncrl.monitor.settings
    import asyncrl.replay.settings
    import asyncrl.rewards.settings
    import asyncrl.runtime
    import asyncrl.sandbox.settings
    import asyncrl.tasks.sampler
    import asyncrl.utils.runlog
    import asyncrl.wiring  # noqa: F401

    out, todo = [], list(Settings.__subclasses__())
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(out, key=lambda c: c.__qualname__)


@pytest.fixture(scope="module")
def cli_config():
    """The config the real CLI composes (``asyncrl-train --cfg job --resolve``)."""
    r = subprocess.run(
        [sys.executable, "-m", "asyncrl.train", "--cfg", "job", "--resolve"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return OmegaConf.create(r.stdout)


def test_python_built_settings_equal_the_clis(cli_config):
    c = cli_config
    cli = LearnerSettings.from_config(c.learner, ClippedISLoss(), c.max_steps)
    assert LearnerSettings.defaults() == cli
    assert cli.optim.schedule == "cosine" and cli.optim.total_steps == c.max_steps
    assert OptimSettings.defaults() == cli.optim
    assert ActorSettings.defaults() == ActorSettings.from_config(c.actor)
    assert BrokerSettings.defaults() == BrokerSettings.from_config(c.broker)


def test_defaults_follow_the_clis_overrides():
    """``defaults(key, overrides)``: the settings of ``asyncrl-train <overrides>``
    (a preset that sets other groups' values included)."""
    small = ActorSettings.from_config(defaults("actor", ["model=small"]))
    assert small.engine.dtype == "bfloat16" and small.sampling.max_tokens == 96
    assert compose_config(["broker=objectstore"]).broker.timeout_s == 120
    with pytest.raises(ConfigError, match="no such option"):
        compose_config(["broker=nope"])


def test_values_merge_into_nested_groups_and_instances_replace():
    s = LearnerSettings.defaults(optim={"lr": 1e-2}, micro_batch_tokens=40)
    assert s.optim.lr == 1e-2 and s.optim.mismatch_kl_target == 0.05
    assert s.micro_batch_tokens == 40 and s.world_size == 1
    plain = OptimSettings.defaults(schedule="constant")
    assert LearnerSettings.defaults(optim=plain).optim is plain


@pytest.mark.parametrize("cls", all_settings(), ids=lambda c: c.__qualname__)
def test_no_settings_field_has_a_default_of_its_own(cls):
    """conf/ holds every value. The one exception: an entry of a mapping the user names
    (``eval.sets.<name>``), whose keys no YAML can list in advance."""
    if cls is EvalSetSettings:
        return
    own = [f.name for f in dataclasses.fields(cls)
           if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING]  # fmt: skip
    assert own == []


@pytest.mark.parametrize("cls", all_settings(), ids=lambda c: c.__qualname__)
def test_every_numeric_setting_has_a_range(cls):
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        numeric = {int, float} & set(typing.get_args(hints[f.name]) or (hints[f.name],))
        if numeric and hints[f.name] is not bool:
            assert isinstance(f.metadata.get("range"), Range), f"{cls.__qualname__}.{f.name}"


@pytest.mark.parametrize("cls", [c for c in all_settings() if c.KEY], ids=lambda c: c.__qualname__)
def test_every_settings_class_builds_from_conf(cls):
    assert isinstance(cls.defaults(), cls)


def test_defaults_compose_inside_a_running_hydra():
    """Inside ``@hydra.main`` (the CLI's driver) or a test's own compose, Hydra is set
    up already: composing the defaults leaves that set-up as it was."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        assert compose_config(["max_steps=9"]).max_steps == 9
        assert compose("config", overrides=["max_steps=8"]).max_steps == 8
