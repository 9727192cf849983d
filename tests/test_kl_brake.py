"""``learner.optim.mismatch_kl_target``: the off-policy brake. Before each step the LR
scale moves by ``(target / KL) ** KL_GAIN`` (within [MIN_LR_SCALE, 1]), KL being the
step's batch's mismatch KL; on-policy it stays 1."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import build_tiny_qwen, plain_optim, trajs
from omegaconf import OmegaConf

from asyncrl.config import ConfigError
from asyncrl.learner.batch import collate
from asyncrl.learner.config import LearnerSettings
from asyncrl.learner.learner import Learner
from asyncrl.learner.optim import KL_GAIN, MIN_LR_SCALE, kl_brake
from asyncrl.losses.advantages import GroupNormalized
from asyncrl.losses.clipped import ClippedISLoss
from asyncrl.losses.decoupled_ppo import DecoupledPPOLoss

LR = 1e-2
TARGET = 0.5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen(tmp_path_factory.mktemp("m"))


def learner(model_dir, lr: float = LR, target: float | None = None) -> Learner:
    torch.set_num_threads(1)
    optim = plain_optim(lr=lr, grad_clip=1e9, mismatch_kl_target=target)
    return Learner(
        str(model_dir), DecoupledPPOLoss(), GroupNormalized(), LearnerSettings.defaults(optim=optim)
    )


def test_the_rule():
    assert kl_brake(0.3, 3.0, None) == 1.0  # off
    assert kl_brake(1.0, 0.01, 0.05) == 1.0  # never above 1: a brake, not an accelerator
    assert kl_brake(0.5, 0.2, 0.05) == pytest.approx(0.5 * 0.25**KL_GAIN)  # over: down
    assert kl_brake(0.5, 0.0125, 0.05) == pytest.approx(0.5 * 4**KL_GAIN)  # under: back up
    assert kl_brake(0.02, float("inf"), 0.05) == MIN_LR_SCALE  # the floor
    assert kl_brake(0.3, float("nan"), 0.05) == 0.3


def test_a_step_over_target_is_the_plain_step_at_the_scaled_lr(model_dir, tmp_path):
    """The test trajectories' behaviour log-probs are random (about -0.5 a token, the
    tiny model's about -3), so their mismatch KL is far over the target."""
    batch = collate(trajs(16, seed=7))
    braked = learner(model_dir, target=TARGET)
    m = braked.step_on_batch(batch, 0)
    kl = m["is/mismatch_kl"]  # the loss's own diagnostics, not the brake's sum
    assert kl > 2 * TARGET
    scale = (TARGET / kl) ** KL_GAIN
    assert m["learner/lr_scale"] == pytest.approx(scale, rel=1e-5)
    assert m["learner/lr"] == pytest.approx(LR * scale, rel=1e-5)
    slow = learner(model_dir, lr=LR * scale)
    slow.step_on_batch(batch, 0)
    plain = learner(model_dir)
    plain.step_on_batch(batch, 0)
    start = learner(model_dir).model.parameters()
    moved, apart = 0.0, 0.0
    for pb, ps, pp, p0 in zip(
        braked.model.parameters(), slow.model.parameters(), plain.model.parameters(), start,
        strict=True,
    ):  # fmt: skip
        torch.testing.assert_close(pb, ps, atol=1e-6, rtol=0)
        moved = max(moved, float((pb - p0).detach().abs().max()))
        apart = max(apart, float((pb - pp).detach().abs().max()))
    assert moved > 1e-4 and apart > 1e-5  # it stepped, and not the plain lr's step
    # the schedule's LR is back after the step; the brake's own scale carries over
    assert braked.opt.param_groups[0]["lr"] == LR
    m2 = braked.step_on_batch(collate(trajs(16, seed=9)), 1)
    scale2 = scale * (TARGET / m2["is/mismatch_kl"]) ** KL_GAIN
    assert m2["learner/lr_scale"] == pytest.approx(scale2, rel=1e-5) and scale2 < scale
    # and a checkpoint keeps it
    braked.save(str(tmp_path / "ck"), export_hf=False)
    again = learner(model_dir, target=TARGET)
    again.load(str(tmp_path / "ck"))
    assert again.lr_scale == braked.lr_scale == pytest.approx(scale2, rel=1e-5)


def test_on_policy_the_step_is_untouched(model_dir):
    braked = learner(model_dir, target=1e-3)
    ts = trajs(16, seed=8)
    own = braked.logprobs_of(ts)  # behaviour = the learner's own policy: KL ~ 0
    ts = [dataclasses.replace(t, behaviour_logprobs=lp) for t, lp in zip(ts, own, strict=True)]
    m = braked.step_on_batch(collate(ts), 0)
    assert m["is/mismatch_kl"] < 1e-6
    assert m["learner/lr_scale"] == 1.0 and m["learner/lr"] == LR


def test_bad_targets_are_refused():
    with pytest.raises(ValueError, match=r"mismatch_kl_target=0.0: expected a number > 0"):
        plain_optim(mismatch_kl_target=0.0)
    lc = OmegaConf.load("conf/learner/default.yaml")
    lc.optim.mismatch_kl_target = -0.1
    with pytest.raises(ConfigError, match=r"learner.optim.mismatch_kl_target=-0.1: expected a"):
        LearnerSettings.from_config(lc, ClippedISLoss(), 10)
