"""``learner.minibatches``: several optimizer steps per batch (PPO-style), one policy
version, advantages and proximal log-probs from the whole batch before the first step."""

from __future__ import annotations

import pytest
import torch
from helpers import build_tiny_qwen, plain_optim, trajs
from omegaconf import OmegaConf

from asyncrl.config import ConfigError
from asyncrl.learner.batch import collate
from asyncrl.learner.config import LearnerSettings
from asyncrl.learner.learner import Learner
from asyncrl.losses.advantages import GroupNormalized
from asyncrl.losses.clipped import ClippedISLoss
from asyncrl.losses.decoupled_ppo import DecoupledPPOLoss

CONF = "conf/learner/default.yaml"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen(tmp_path_factory.mktemp("m"))


def learner(model_dir, loss, minibatches: int) -> Learner:
    torch.set_num_threads(1)
    optim = plain_optim(lr=1e-2, grad_clip=1e9)
    settings = LearnerSettings.defaults(optim=optim, minibatches=minibatches)
    return Learner(str(model_dir), loss, GroupNormalized(), settings)


def test_two_minibatches_are_two_steps_on_the_halves(model_dir):
    """16 trajectories in groups of 4: each half holds whole groups, so its advantages
    are the whole batch's, and one call with minibatches=2 must equal two plain steps."""
    ts = trajs(16, seed=5)
    a = learner(model_dir, ClippedISLoss(), 2)
    m = a.step_on_batch(collate(ts), 0)
    b = learner(model_dir, ClippedISLoss(), 1)
    b.step_on_batch(collate(ts[:8]), 0)
    b.step_on_batch(collate(ts[8:]), 1)
    assert m["learner/optimizer_steps"] == 2 and a.version == 1 and b.version == 2
    assert a.opt.state[next(iter(a.model.parameters()))]["step"] == 2
    start = learner(model_dir, ClippedISLoss(), 1).model.parameters()
    moved = 0.0
    for pa, pb, p0 in zip(a.model.parameters(), b.model.parameters(), start, strict=True):
        torch.testing.assert_close(pa, pb, atol=2e-5, rtol=0)
        moved = max(moved, float((pa - p0).detach().abs().max()))
    assert moved > 1e-3  # two AdamW steps at lr 1e-2 really moved the weights


class _Spy(DecoupledPPOLoss):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __call__(self, batch, outputs):
        m = batch.mask
        prox, now = batch.proximal_logprobs[m], outputs.logprobs.detach()[m]
        self.calls.append((float(prox.double().sum()), float((prox - now).abs().max())))
        return super().__call__(batch, outputs)


def test_the_proximal_policy_is_the_batchs_start_for_every_minibatch(model_dir):
    ts = trajs(16, seed=6)
    spy = _Spy()
    L = learner(model_dir, spy, 2)
    start = L.logprobs_of(ts)  # the policy before the step
    L.step_on_batch(collate(ts), 0)
    (sum1, d1), (sum2, d2) = spy.calls  # one micro-batch per minibatch
    assert sum1 == pytest.approx(sum(float(x.sum()) for x in start[:8]), abs=1e-4)
    assert sum2 == pytest.approx(sum(float(x.sum()) for x in start[8:]), abs=1e-4)
    assert d1 < 1e-5  # the first step starts at the proximal policy
    assert d2 > 1e-3  # the second is measured against it, not against its own start


def test_minibatches_bad_values_and_a_short_batch(model_dir):
    with pytest.raises(ValueError, match="learner.minibatches=0: expected an integer >= 1"):
        learner(model_dir, ClippedISLoss(), 0)
    L = learner(model_dir, ClippedISLoss(), 5)  # a short batch: one step per trajectory
    assert L.step_on_batch(collate(trajs(4)), 0)["learner/optimizer_steps"] == 4
    assert L.version == 1
    lc = OmegaConf.load(CONF)
    lc.minibatches = 0
    with pytest.raises(ConfigError, match="learner.minibatches=0: expected an integer >= 1"):
        LearnerSettings.from_config(lc, ClippedISLoss(), 10)


def test_the_schedule_horizon_counts_optimizer_steps():
    lc = OmegaConf.load(CONF)
    lc.minibatches = 4
    loss = ClippedISLoss()
    assert LearnerSettings.from_config(lc, loss, 300).optim.total_steps == 1200
    lc.optim.total_steps = 50
    assert LearnerSettings.from_config(lc, loss, 300).optim.total_steps == 50
