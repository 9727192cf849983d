"""The divergence-masking, sequence-ratio and clipped-weight losses and the log-linear
proximal policy: hand-made cases, edge cases and the shipped configs.

The random-input comparisons with the float64 loop references live in test_losses.py
(``CASES``); here each loss's defining behaviour is checked on numbers small enough to
work out by hand."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from reference_losses import (
    make_batch,
    ref_cispo,
    ref_decoupled,
    ref_dppo_mask,
    ref_gspo,
    ref_icepop,
    ref_m2po,
)

from asyncrl.config import build
from asyncrl.losses.base import Loss, ModelOutputs
from asyncrl.losses.cispo import CISPOLoss
from asyncrl.losses.decoupled_ppo import DecoupledPPOLoss
from asyncrl.losses.dppo_mask import DPPOMaskLoss
from asyncrl.losses.gspo import GSPOLoss
from asyncrl.losses.icepop import IcePopLoss
from asyncrl.losses.m2po import M2POLoss
from asyncrl.losses.proximal import loglinear_alpha, loglinear_proximal
from asyncrl.losses.tis import TISLoss

CONF = Path(__file__).parents[1] / "conf"
L2 = math.log(2.0)

NEW = {
    "dppo_mask": lambda: DPPOMaskLoss(),
    "dppo_mask_kl": lambda: DPPOMaskLoss("kl", 0.02, 0.03),
    "icepop": lambda: IcePopLoss(),
    "icepop_loglinear": lambda: IcePopLoss(proximal="loglinear"),
    "m2po": lambda: M2POLoss(),
    "gspo": lambda: GSPOLoss(),
    "cispo": lambda: CISPOLoss(),
    "decoupled_ppo_loglinear": lambda: DecoupledPPOLoss(proximal="loglinear"),
}


def grad_of(loss, batch, lp):
    out = loss(batch, ModelOutputs(logprobs=lp))
    value = out.loss if hasattr(out, "loss") else out  # a loop reference returns the scalar
    (g,) = torch.autograd.grad(value, lp, allow_unused=True)
    return out, torch.zeros_like(lp) if g is None else g


def one_row(behaviour, current, adv, proximal=None, versions=None, learner_version=0):
    """A one-trajectory batch with the given per-token log-probs, advantage and versions."""
    n = len(behaviour)
    batch, _ = make_batch(1, n, seed=0, lengths=[n])
    batch.behaviour_logprobs = torch.tensor([behaviour], dtype=torch.float64)
    batch.advantages = torch.full((1, n), float(adv), dtype=torch.float64)
    batch.proximal_logprobs = (
        None if proximal is None else torch.tensor([proximal], dtype=torch.float64)
    )
    batch.versions = torch.tensor([versions or [learner_version] * n])
    batch.learner_version = learner_version
    return batch, torch.tensor([current], dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("name", NEW)
def test_all_tokens_masked_gives_zero_and_finite_metrics(name):
    batch, outputs = make_batch(3, 4, seed=5)
    batch.mask = torch.zeros_like(batch.mask)
    batch.loss_weights = torch.zeros_like(batch.loss_weights)
    out, g = grad_of(NEW[name](), batch, outputs.logprobs)
    assert float(out.loss.detach()) == 0.0 and torch.all(g == 0)
    assert all(math.isfinite(v) for v in out.metrics.values()), out.metrics


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("lengths", [[1], [0, 1], [0, 0, 3]])
def test_one_token_and_empty_rows(name, lengths):
    """A single valid token, and empty rows next to it: finite, padding gets no gradient,
    and the one token is trained on exactly as its own loss says."""
    batch, outputs = make_batch(len(lengths), 3, seed=2, lengths=lengths, log_ratio_scale=0.05)
    out, g = grad_of(NEW[name](), batch, outputs.logprobs)
    assert torch.isfinite(out.loss) and torch.isfinite(g).all()
    assert torch.all(g[~batch.mask] == 0)
    assert all(math.isfinite(v) for v in out.metrics.values())


def test_dppo_mask_direction_follows_the_advantage():
    """Probabilities 0.5 -> 0.8 (up 0.3) and 0.5 -> 0.2 (down 0.3), high = low = 0.2: with
    A > 0 the token that went up is dropped, with A < 0 the one that went down."""
    mu = [math.log(0.5)] * 2
    cur = [math.log(0.8), math.log(0.2)]
    for adv, dropped in ((1.0, 0), (-1.0, 1)):
        batch, lp = one_row(mu, cur, adv)
        out, g = grad_of(DPPOMaskLoss(kl_coef=0.0), batch, lp)
        rho = [0.8 / 0.5, 0.2 / 0.5]
        want = [0.0 if i == dropped else -adv * rho[i] / 2 for i in range(2)]
        torch.testing.assert_close(g, torch.tensor([want], dtype=torch.float64))
        assert out.metrics["is/masked_fraction"] == 0.5
        key = "is/masked_fraction_high" if adv > 0 else "is/masked_fraction_low"
        assert out.metrics[key] == 0.5


def test_dppo_mask_threshold_is_kept_and_just_past_it_is_dropped():
    batch, lp = one_row([math.log(0.5)], [math.log(0.75)], 1.0)
    tv = float(lp.detach().exp() - batch.behaviour_logprobs.exp())
    kept = DPPOMaskLoss(high=tv)(batch, ModelOutputs(logprobs=lp))
    dropped = DPPOMaskLoss(high=math.nextafter(tv, 0.0))(batch, ModelOutputs(logprobs=lp))
    assert kept.metrics["is/masked_fraction"] == 0.0
    assert dropped.metrics["is/masked_fraction"] == 1.0
    for loss in (DPPOMaskLoss(high=tv), DPPOMaskLoss(high=math.nextafter(tv, 0.0))):
        _, g = grad_of(loss, batch, lp)
        _, want = grad_of(
            lambda b, o, h=loss.high: ref_dppo_mask(b, o, "tv", 0.2, h, 1e-3), batch, lp
        )
        torch.testing.assert_close(g, want, rtol=1e-12, atol=0)


def test_dppo_mask_kl_penalty_pulls_towards_the_sampler():
    """Every valid token, masked or not, gets 2 kl_coef log(rho) of gradient from the penalty."""
    batch, lp = one_row([math.log(0.5)], [math.log(0.9)], 1.0)  # up 0.4: dropped
    out, g = grad_of(DPPOMaskLoss(kl_coef=0.5), batch, lp)
    assert out.metrics["is/masked_fraction"] == 1.0
    torch.testing.assert_close(g, torch.tensor([[2 * 0.5 * math.log(0.9 / 0.5)]]).double())


def test_icepop_band_edges_are_kept():
    """pi_prox/mu exactly 2 (= high) is kept, just above is dropped; low likewise."""
    mu = [-2 * L2, -L2, -2 * L2]
    prox = [-L2, -2 * L2, math.nextafter(-L2, 0.0)]  # ratios 2, 1/2, just above 2
    assert prox[0] - mu[0] == L2 and prox[1] - mu[1] == -L2 and prox[2] - mu[2] > L2
    batch, lp = one_row(mu, prox, 1.0, proximal=prox)
    out, g = grad_of(IcePopLoss(low=0.5, high=2.0), batch, lp)
    assert out.metrics["is/masked_fraction"] == pytest.approx(1 / 3)
    assert g[0, 2] == 0 and g[0, 0] != 0 and g[0, 1] != 0
    _, want = grad_of(lambda b, o: ref_icepop(b, o, 0.5, 2.0, 0.2, 0.2), batch, lp)
    torch.testing.assert_close(g, want, rtol=1e-12, atol=0)


def test_icepop_is_decoupled_ppo_inside_the_band():
    """When no token leaves the band and none is truncated, IcePop and decoupled PPO agree."""
    batch, outputs = make_batch(4, 5, seed=4, log_ratio_scale=0.1)
    big = IcePopLoss(low=0.0, high=1e9, clip_low=0.2, clip_high=0.3)
    _, g = grad_of(big, batch, outputs.logprobs)
    _, want = grad_of(lambda b, o: ref_decoupled(b, o, 0.2, 0.3, 1e9), batch, outputs.logprobs)
    torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-15)


def test_m2po_drops_the_largest_until_the_mean_is_below():
    """log-ratios 0.5, 0.1, 0, -0.3 (m2 0.25, 0.01, 0, 0.09; mean 0.0875). With threshold
    0.04 the 0.25 goes (mean of the rest 0.0333); at 0.03 the 0.09 goes too (0.005)."""
    mu = [-1.0, -1.0, -1.0, -1.0]
    cur = [-0.5, -0.9, -1.0, -1.3]
    batch, lp = one_row(mu, cur, 1.0)
    out, g = grad_of(M2POLoss(0.04), batch, lp)
    assert [bool(x != 0) for x in g[0]] == [False, True, True, True]
    assert out.metrics["is/masked_fraction"] == 0.25
    out, g = grad_of(M2POLoss(0.03), batch, lp)
    assert [bool(x != 0) for x in g[0]] == [False, True, True, False]
    assert out.metrics["is/m2_kept"] == pytest.approx((0.1**2) / 2)


def test_m2po_mean_exactly_at_the_threshold_is_not_below_it():
    """m2 0.25 and 0 have mean 0.125 (exact): at threshold 0.125 the larger is dropped; the
    smallest is always kept, even when it alone is above the threshold."""
    batch, lp = one_row([-1.0, -1.0], [-0.5, -1.0], 1.0)
    assert grad_of(M2POLoss(0.125), batch, lp)[0].metrics["is/masked_fraction"] == 0.5
    assert grad_of(M2POLoss(0.1250001), batch, lp)[0].metrics["is/masked_fraction"] == 0.0
    batch, lp = one_row([-1.0, -1.0], [-0.5, -0.5], 1.0)  # a tie: the later one goes
    out, g = grad_of(M2POLoss(0.01), batch, lp)
    assert g[0, 0] != 0 and g[0, 1] == 0
    torch.testing.assert_close(out.loss.detach(), ref_m2po(batch, ModelOutputs(logprobs=lp), 0.01))


def test_gspo_clips_whole_answers():
    """Two answers: log-ratios (0.1, -0.1) (s = 1, inside) and (0.2, 0.2) (s = e^0.2,
    clipped with A > 0): the second answer's tokens get no gradient, the first's s A."""
    batch, _ = make_batch(2, 2, seed=0, lengths=[2, 2])
    batch.behaviour_logprobs = torch.full((2, 2), -1.0, dtype=torch.float64)
    batch.advantages = torch.ones(2, 2, dtype=torch.float64)
    lp = torch.tensor([[-0.9, -1.1], [-0.8, -0.8]], dtype=torch.float64, requires_grad=True)
    out, g = grad_of(GSPOLoss(0.1, 0.1), batch, lp)
    s0 = math.exp((0.1 - 0.1) / 2)
    torch.testing.assert_close(g, torch.tensor([[-s0 / 4, -s0 / 4], [0.0, 0.0]]).double())
    assert out.metrics["is/clip_frac"] == 0.5
    assert out.metrics["is/seq_ratio_mean"] == pytest.approx((1 + math.exp(0.2)) / 2)


def test_gspo_ratio_exactly_at_the_bound():
    """A one-token answer whose ratio is exactly 1 + clip_high is not clipped: the
    gradient is the unclipped one, as the reference computes it."""
    batch, lp = one_row([-2 * L2], [-L2], 1.0)
    out, g = grad_of(GSPOLoss(0.0, 1.0), batch, lp)
    _, want = grad_of(lambda b, o: ref_gspo(b, o, 0.0, 1.0), batch, lp)
    torch.testing.assert_close(g, want, rtol=1e-12, atol=0)
    assert out.metrics["is/clip_frac"] == 0.0


def test_cispo_keeps_every_gradient_and_clips_the_weight():
    """Ratios 4, 2 (exactly the bound 1 + 1), 1 and 0.25 with clip (0.5, 1): weights 2, 2,
    1, 0.5; every token has a gradient (unlike PPO's clip); 2 of 4 were clipped."""
    mu = [-2 * L2, -2 * L2, -1.0, -1.0]
    cur = [0.0, -L2, -1.0, -1.0 - 2 * L2]
    batch, lp = one_row(mu, cur, 1.0)
    assert cur[1] - mu[1] == math.log1p(1.0)
    out, g = grad_of(CISPOLoss(0.5, 1.0), batch, lp)
    torch.testing.assert_close(g, -torch.tensor([[2.0, 2.0, 1.0, 0.5]]).double() / 4)
    assert out.metrics["is/clip_frac"] == 0.5
    _, want = grad_of(lambda b, o: ref_cispo(b, o, 0.5, 1.0), batch, lp)
    torch.testing.assert_close(g, want, rtol=1e-12, atol=0)


def test_cispo_without_lower_bound_is_token_tis():
    batch, outputs = make_batch(5, 6, seed=9, holes=True, log_ratio_scale=0.6)
    _, g = grad_of(CISPOLoss(1.0, 0.28), batch, outputs.logprobs)
    _, want = grad_of(TISLoss("token", cap=1.28), batch, outputs.logprobs)
    torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-15)


def test_loglinear_alpha_from_versions():
    """Learner at version 10; tokens of versions 10, 9, 7 (staleness 0, 1, 3) get alpha
    0, 1/2, 3/4: the proximal log-prob moves from mu towards pi."""
    batch, lp = one_row([-1.0, -1.0, -1.0], [-0.2, -0.2, -0.2], 1.0, versions=[10, 9, 7],
                        learner_version=10)  # fmt: skip
    torch.testing.assert_close(loglinear_alpha(batch), torch.tensor([[0.0, 0.5, 0.75]]).double())
    prox = loglinear_proximal(batch, ModelOutputs(logprobs=lp))
    torch.testing.assert_close(prox, torch.tensor([[-1.0, -0.6, -0.4]]).double())
    assert not prox.requires_grad
    out = DecoupledPPOLoss(proximal="loglinear")(batch, ModelOutputs(logprobs=lp))
    assert out.metrics["is/proximal_alpha_mean"] == pytest.approx(1.25 / 3)


def test_loglinear_on_fresh_tokens_is_the_sampler_as_proximal():
    """Every token of the learner's own version: pi_prox = mu, so loglinear equals the
    recomputed form with proximal_logprobs = behaviour_logprobs, and needs no batch field."""
    batch, outputs = make_batch(5, 6, seed=3, holes=True)
    batch.versions = torch.full_like(batch.versions, batch.learner_version)
    approx = DecoupledPPOLoss(0.2, 0.3, 1.3, proximal="loglinear")
    _, g = grad_of(approx, dataclasses.replace(batch, proximal_logprobs=None), outputs.logprobs)
    exact = dataclasses.replace(batch, proximal_logprobs=batch.behaviour_logprobs.clone())
    _, want = grad_of(DecoupledPPOLoss(0.2, 0.3, 1.3), exact, outputs.logprobs)
    torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-15)


def test_recompute_still_refuses_a_missing_proximal():
    batch, outputs = make_batch(3, 4, seed=0)
    batch = dataclasses.replace(batch, proximal_logprobs=None)
    for loss in (DecoupledPPOLoss(), IcePopLoss()):
        with pytest.raises(ValueError, match="proximal"):
            loss(batch, outputs)


def test_random_inputs_exercise_the_masks():
    """The reference comparisons in test_losses.py mean something only if the masks and
    clips bite on their inputs: on those batches some but not all tokens are dropped."""
    fracs = {"dppo": [], "m2po": [], "icepop": []}
    for seed in range(4):
        batch, outputs = make_batch(6, 7, seed=seed, holes=True, log_ratio_scale=0.4)
        fracs["dppo"].append(DPPOMaskLoss("tv", 0.1, 0.15)(batch, outputs).metrics)
        fracs["m2po"].append(M2POLoss(0.04)(batch, outputs).metrics)
        fracs["icepop"].append(IcePopLoss(0.7, 1.5)(batch, outputs).metrics)
    for name, ms in fracs.items():
        total = sum(m["is/masked_fraction"] for m in ms)
        assert 0 < total < len(ms), (name, total)


@pytest.mark.parametrize("group", ["dppo_mask", "icepop", "m2po", "gspo", "cispo", "decoupled_ppo"])
def test_shipped_configs_build(group):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose("config", overrides=[f"loss={group}"])
    loss = build("loss", cfg.loss)
    assert isinstance(loss, Loss)
    batch, outputs = make_batch(4, 5, seed=0)
    assert torch.isfinite(loss(batch, outputs).loss)


def test_loglinear_from_the_command_line_turns_the_forward_pass_off():
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose("config", overrides=["loss=decoupled_ppo", "loss.proximal=loglinear"])
    assert build("loss", cfg.loss).needs_proximal is False
