"""``learner`` config mistakes stop the run at start-up, naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import plain_optim
from hydra import compose, initialize_config_dir

from asyncrl.config import ConfigError
from asyncrl.learner.config import LearnerSettings
from asyncrl.learner.optim import lr_factor
from asyncrl.losses.clipped import ClippedISLoss
from asyncrl.runtime import check_resources
from asyncrl.wiring import prepare

CONF = Path(__file__).parents[1] / "conf"


def cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["learner.value_head=true"], r"learner.value_head=true but the loss .* does not use"),
        (["loss=vtrace", "loss.use_value_head=true"], r"set learner.value_head=true"),
        (["learner.world_size=0"], r"learner.world_size=0: expected an integer >= 1"),
        (["learner.normalisation=batch"], r"learner.normalisation='batch': expected one of"),
        (["learner.optim.schedule=linear"], r"learner.optim.schedule=.linear.: expected one of"),
        (["learner.pack_row_tokens=0"], r"learner.pack_row_tokens=0: expected an integer >= 1"),
        (["learner.autocast=float16"], r"learner.autocast='float16': expected one of"),
    ],
)
def test_learner_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        prepare(cfg(*overrides))


def test_resume_from_a_non_checkpoint_fails_at_start(tmp_path):
    with pytest.raises(ConfigError, match=r"resume=.*manifest.json is missing"):
        prepare(cfg(f"resume={tmp_path}"))


def test_world_size_beyond_ray_cpus_fails_with_the_numbers(ray_local, tiny_model):
    setup = prepare(cfg("learner.world_size=8"))  # 8 ranks x 1 CPU + the actor's on 4 CPUs
    with pytest.raises(ConfigError, match=r"needs 9 Ray CPUs \(actors: 1, learner: 8\).* has 4"):
        check_resources(setup.resources)


def test_lr_schedule_shapes():
    const = plain_optim(lr=1.0, warmup_steps=4)
    assert [lr_factor(k, const) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = plain_optim(lr=1.0, warmup_steps=2, schedule="cosine", total_steps=6, min_lr_ratio=0.1)
    f = [lr_factor(k, cos) for k in range(8)]
    assert f[:3] == [0.5, 1.0, 1.0] and f[4] == pytest.approx(0.55)
    assert f[6] == f[7] == pytest.approx(0.1) and all(a >= b for a, b in zip(f[2:], f[3:]))


def test_the_default_lr_decays_over_the_run():
    """The default the staleness benchmark measured (README, Benchmarks): the peak LR
    at the first step, a cosine to 0 at the run's last, whatever ``max_steps`` is."""
    c = cfg("max_steps=100")
    s = LearnerSettings.from_config(c.learner, ClippedISLoss(), c.max_steps).optim
    f = [lr_factor(k, s) for k in range(100)]
    assert f[0] == 1.0 and f[50] == pytest.approx(0.5) and f[99] < 1e-3
    assert all(a >= b for a, b in zip(f, f[1:]))
