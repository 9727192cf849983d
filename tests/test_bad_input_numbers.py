"""Every numeric setting has a range: NaN, inf and out-of-range values are refused before
Ray starts, with one line naming the key (one rule in the settings layer:
``asyncrl.config.settings_from`` / ``Settings``, ranges declared on the fields)."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest
from helpers import refused_before_ray
from test_settings_defaults import all_settings

from asyncrl.config import ConfigError, Range, compose_config


def numeric_fields() -> list[tuple[type, str, type, Range]]:
    """(class, field, int or float, range) of every numeric setting with a KEY in conf/."""
    out = []
    for cls in all_settings():
        if not cls.KEY:
            continue
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kinds = [t for t in typing.get_args(hints[f.name]) or (hints[f.name],)
                     if t in (int, float)]  # fmt: skip
            if kinds and hints[f.name] is not bool and f.name != "betas":
                out.append((cls, f.name, kinds[0], f.metadata["range"]))
    return out


FIELDS = numeric_fields()
IDS = [f"{c.KEY}.{n}" for c, n, _, _ in FIELDS]


@pytest.mark.parametrize(("cls", "name", "kind", "accepts"), FIELDS, ids=IDS)
def test_nan_inf_and_out_of_range_values_are_refused_naming_the_key(cls, name, kind, accepts):
    key = f"{cls.KEY}.{name}"
    bad: list[float] = []
    if kind is float:
        bad += [math.nan, -math.inf] + ([] if accepts.inf else [math.inf])
    if accepts.low is not None:
        bad.append(kind(accepts.low) - (0 if accepts.low_open else 1))
    if accepts.high is not None:
        bad.append(kind(accepts.high) + (0 if accepts.high_open else 1))
    for value in bad:
        with pytest.raises(ConfigError) as e:
            cls.defaults(**{name: value})
        assert str(e.value).startswith(f"{key}="), str(e.value)
        assert "\n" not in str(e.value)


def test_the_sweep_covers_the_named_settings():
    keys = set(IDS)
    assert {"learner.optim.lr", "learner.optim.grad_clip", "broker.timeout_s",
            "broker.join_timeout_s", "sandbox.timeout_s", "sandbox.memory_mb",
            "sandbox.open_files"} <= keys  # fmt: skip
    assert len(keys) > 60


# The CLI's path: `asyncrl-train <override>` exits 2 with one line naming the key.
CLI = [
    ("sandbox.timeout_s=nan", "sandbox.timeout_s=nan: expected a number in (0, 3600]"),
    ("sandbox.timeout_s=1e10", "sandbox.timeout_s=10000000000.0: expected a number in (0, 3600]"),
    ("sandbox.memory_mb=10000000000", "sandbox.memory_mb=10000000000: expected an integer in"),
    ("sandbox.open_files=100000000", "sandbox.open_files=100000000: expected an integer in"),
    ("learner.optim.lr=nan", "learner.optim.lr=nan: expected a number > 0"),
    ("learner.optim.lr=inf", "learner.optim.lr=inf: expected a number > 0"),
    ("learner.optim.grad_clip=nan", "learner.optim.grad_clip=nan"),
    ("learner.optim.grad_clip=inf", "learner.optim.grad_clip=inf"),
    ("learner.collective_timeout_s=1e10", "learner.collective_timeout_s=10000000000.0"),
    ("broker.timeout_s=inf", "broker.timeout_s=inf"),
    ("broker.join_timeout_s=nan", "broker.join_timeout_s=nan"),
    ("broker.pause_timeout_s=-1", "broker.pause_timeout_s=-1.0"),
    ("broker.bucket_mb=nan", "broker.bucket_mb=nan"),
    ("replay.wait_timeout_s=inf", "replay.wait_timeout_s=inf"),
    ("actor.sampling.temperature=nan", "actor.sampling.temperature=nan"),
    ("actor.handoff_linger_ms=inf", "actor.handoff_linger_ms=inf"),
    ("env.timeout_s=inf", "env.timeout_s=inf"),
    ("fault.actor_start_timeout_s=nan", "fault.actor_start_timeout_s=nan"),
    ("eval.heldout_frac=nan", "eval.heldout_frac=nan"),
    ("reward.on_error=nan", "reward.on_error=nan"),
    ("reward.monitor.min_rise=inf", "reward.monitor.min_rise=inf"),
    ("log.sample_frac=nan", "log.sample_frac=nan"),
    ("ray.connect_timeout_s=inf", "ray.connect_timeout_s=inf"),
    ("model.tiny.warm_start_lr=nan", "model.tiny.warm_start_lr=nan"),
    ("+loss.clip_low=nan", "loss.clip_low=nan: expected a finite number"),
]


@pytest.mark.parametrize(("override", "names"), CLI, ids=[o for o, _ in CLI])
def test_the_cli_refuses_a_bad_number_before_ray(override, names, tmp_path, capsys, monkeypatch):
    line = refused_before_ray(compose_config([override, "progress=false"]), tmp_path, capsys,
                              monkeypatch)  # fmt: skip
    assert names in line, line


# An env's own keys and the task it takes (env=visual_addition_mt: docs/vision.md).
ENV_CLI = [
    (["env=visual_addition_mt", "env.retry_credit=nan"], "env.retry_credit=nan: expected"),
    (["env=visual_addition_mt", "env.retries=0"], "env.retries=0: expected an integer in [1, 8]"),
    (["env=visual_addition_mt", "task=addition"],
     "env._target_=asyncrl.envs.visual.VisualRetryEnv: draws task=visual_addition's sums"),
]  # fmt: skip


@pytest.mark.parametrize(("overrides", "names"), ENV_CLI, ids=[o[-1] for o, _ in ENV_CLI])
def test_the_cli_refuses_an_envs_bad_key_before_ray(overrides, names, tmp_path, capsys,
                                                   monkeypatch):  # fmt: skip
    line = refused_before_ray(compose_config([*overrides, "progress=false"]), tmp_path, capsys,
                              monkeypatch)  # fmt: skip
    assert names in line, line
