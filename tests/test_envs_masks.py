"""Observation tokens (loss mask 0) are invisible to training: changing their behaviour
log-probs, versions or current log-probs changes neither a loss, its gradient, the IS
statistics, staleness, nor a whole learner step."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers import build_tiny_qwen, plain_optim
from reference_losses import make_batch

from asyncrl.learner.batch import collate
from asyncrl.learner.config import LearnerSettings
from asyncrl.learner.learner import Learner
from asyncrl.learner.metrics import trajectory_metrics
from asyncrl.learner.shard import RowSummary
from asyncrl.losses.advantages import GroupNormalized
from asyncrl.losses.base import ModelOutputs
from asyncrl.losses.clipped import ClippedISLoss
from asyncrl.losses.decoupled_ppo import DecoupledPPOLoss
from asyncrl.losses.diagnostics import is_diagnostics, mismatch_kl_sum
from asyncrl.losses.mis import MaskedISLoss
from asyncrl.losses.plain_pg import PlainPGLoss
from asyncrl.losses.tis import TISLoss
from asyncrl.losses.vtrace import VTraceLoss
from asyncrl.trajectory import Trajectory

LOSSES = {
    "clipped": ClippedISLoss(0.2, 0.28),
    "tis_token": TISLoss("token", cap=1.5),
    "tis_sequence": TISLoss("sequence", cap=1.5),
    "mis_token": MaskedISLoss("token", 0.7, 1.4),
    "mis_sequence": MaskedISLoss("sequence", 0.8, 1.25),
    "decoupled_ppo": DecoupledPPOLoss(0.2, 0.3, 1.3),
    "decoupled_ppo_sequence": DecoupledPPOLoss(0.2, 0.3, 1.3, level="sequence"),
    "plain_pg": PlainPGLoss(),
    "vtrace": VTraceLoss(use_value_head=False),
}


def _scramble(batch, outputs, seed: int):
    """The same batch with garbage on every masked position (observation tokens): far
    off log-probs, and versions far older than any generated token's."""
    g = torch.Generator().manual_seed(seed)
    off = ~batch.mask

    def junk(x: torch.Tensor) -> torch.Tensor:
        return torch.where(off, -20 * torch.rand(x.shape, generator=g, dtype=x.dtype), x)

    b2 = dataclasses.replace(
        batch,
        behaviour_logprobs=junk(batch.behaviour_logprobs),
        proximal_logprobs=junk(batch.proximal_logprobs),
        versions=torch.where(off, torch.zeros_like(batch.versions) - 50, batch.versions),
    )
    out2 = ModelOutputs(logprobs=junk(outputs.logprobs.detach()).requires_grad_(True))
    return b2, out2


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", list(LOSSES))
def test_masked_tokens_change_neither_loss_nor_is_statistics(name, seed):
    loss = LOSSES[name]
    batch, outputs = make_batch(B=6, T=9, seed=seed, holes=True)
    assert (~batch.mask).any() and batch.mask.any()
    b2, out2 = _scramble(batch, outputs, seed + 100)
    r1, r2 = loss(batch, outputs), loss(b2, out2)
    (g1,) = torch.autograd.grad(r1.loss, outputs.logprobs, allow_unused=True)
    (g2,) = torch.autograd.grad(r2.loss, out2.logprobs, allow_unused=True)
    assert torch.equal(r1.loss.detach(), r2.loss.detach()), name
    assert r1.metrics == r2.metrics, name
    if g1 is not None:
        assert torch.equal(g1, g2)
        assert (g1[~batch.mask] == 0).all()
    assert is_diagnostics(batch, outputs) == is_diagnostics(b2, out2)
    assert torch.equal(batch.staleness, b2.staleness)
    kl1 = mismatch_kl_sum(outputs.logprobs, batch.behaviour_logprobs, batch.mask)
    kl2 = mismatch_kl_sum(out2.logprobs, b2.behaviour_logprobs, b2.mask)
    assert torch.equal(kl1, kl2)


def _episode(rng, i: int, obs_version: int) -> Trajectory:
    """A two-turn episode: generated (version 3), observation, generated (version 4)."""
    a, o, b = (int(x) for x in rng.integers(1, 5, 3))
    r = a + o + b
    mask = np.r_[np.ones(a, bool), np.zeros(o, bool), np.ones(b, bool)]
    versions = np.r_[np.full(a, 3), np.full(o, obs_version), np.full(b, 4)]
    return Trajectory(
        f"t{i}", f"g{i // 4}", rng.integers(1, 20, 3), rng.integers(1, 20, r),
        -rng.random(r).astype(np.float32), versions, mask, float(i % 2),
    )  # fmt: skip


def test_observation_versions_do_not_count_as_staleness():
    rng = np.random.default_rng(0)
    ts = [_episode(rng, i, obs_version=0) for i in range(8)]
    assert all(t.min_version == 3 and t.max_version == 4 for t in ts)
    m = trajectory_metrics([RowSummary.of(t) for t in ts], learner_version=5)
    assert m["staleness/max"] == 2 and m["staleness/mean"] == 2
    assert m["tokens/trained"] == sum(int(t.loss_mask.sum()) for t in ts)  # no observation


def test_a_learner_step_ignores_masked_tokens(tmp_path):
    """Two learners from the same weights, one step each on the same episodes, one with
    the observations' behaviour log-probs and versions scrambled: the same metrics and
    the same weights after the step."""
    torch.set_num_threads(1)
    model_dir = build_tiny_qwen(tmp_path)
    rng = np.random.default_rng(1)
    ts = [_episode(rng, i, obs_version=3) for i in range(8)]
    for t in ts:  # the learner at version 0 trains versions 0 and 1 (stale by 0 and 1)
        t.versions = t.versions - 3
    scrambled = []
    for t in ts:
        t2 = dataclasses.replace(t)
        off = ~t.loss_mask
        t2.behaviour_logprobs = np.where(off, -30.0, t.behaviour_logprobs).astype(np.float32)
        t2.versions = np.where(off, -7, t.versions).astype(np.int32)
        scrambled.append(t2)
    results = []
    for batch in (ts, scrambled):
        learner = Learner(
            str(model_dir), DecoupledPPOLoss(), GroupNormalized(),
            LearnerSettings.defaults(optim=plain_optim(lr=1e-2, mismatch_kl_target=None)),
        )  # fmt: skip
        metrics = learner.step_on_batch(collate(batch), 0)
        results.append((metrics, [p.detach().clone() for p in learner.model.parameters()]))
    (m1, p1), (m2, p2) = results
    drop = ("perf/", "time/")
    assert {k: v for k, v in m1.items() if not k.startswith(drop)} == {
        k: v for k, v in m2.items() if not k.startswith(drop)
    }
    assert all(torch.equal(a, b) for a, b in zip(p1, p2))
