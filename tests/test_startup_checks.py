"""Every component's settings are checked in the driver before Ray starts: a bad value
stops the run with exit 2 and one line naming the key (``asyncrl.train.execute``, what
the CLI runs after Hydra composed the config)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

CONF = Path(__file__).parents[1] / "conf"

# (component, override, what the one line must name)
BAD = [
    ("run", "max_steps=abc", "max_steps='abc': expected an integer"),
    ("run", "max_steps=0", "max_steps=0"),
    ("ray", "ray.num_cpus=0", "ray.num_cpus=0"),
    ("actor", "actor.update_mode=bogus", "actor.update_mode"),
    ("actor", "actor.sampling.n=0", "actor.sampling.n"),
    ("actor", "actor.max_inflight_groups=0", "actor.max_inflight_groups"),
    (
        "replay",
        "replay.policy=bogus",
        "replay.policy='bogus': expected one of ['throttle', 'drop']",
    ),
    ("replay", "replay.max_staleness=-1", "replay.max_staleness=-1"),
    ("learner", "learner.world_size=0", "learner.world_size"),
    ("learner", "learner.normalisation=batch", "learner.normalisation"),
    ("learner", "learner.batch_groups=0", "learner.batch_groups"),
    ("broker", "broker.mode=bogus", "broker.mode"),
    ("broker", "broker.timeout_s=0", "broker.timeout_s"),
    ("loss", "+loss.clip_low=-1", "loss: building"),
    ("task", "task.max_operand=0", "task.max_operand must be >= 1"),
    ("model", "model.tiny.num_heads=8", "model.tiny"),
    ("sandbox", "sandbox.workers=0", "sandbox.workers=0: must be >= 1"),
]


def cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize("component,override,names", BAD, ids=[f"{c}:{o}" for c, o, _ in BAD])
def test_a_bad_value_stops_the_run_before_ray(
    component, override, names, tmp_path, capsys, monkeypatch
):
    import asyncrl.train
    from asyncrl.train import execute

    def no_ray(*_a, **_k):
        raise AssertionError("Ray was started before the config was refused")

    monkeypatch.setattr(asyncrl.train, "init_ray", no_ray)
    code = execute(cfg(override, "progress=false"), tmp_path / "out")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("asyncrl: config error: "), err
    assert names in err[0], err[0]
    assert not (tmp_path / "out").exists()  # and before anything was written


def test_every_component_has_a_bad_value_case():
    assert {c for c, _, _ in BAD} >= {
        "run", "ray", "actor", "replay", "learner", "broker", "loss", "task", "model"
    }  # fmt: skip
