"""V-trace against the paper (section 4 of Espeholt et al. 2018) and its loss against loops."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from reference_losses import make_batch, ref_vtrace_loss, ref_vtrace_row, ref_vtrace_row_recursive

from asyncrl.losses.advantages import GroupCentered, LeaveOneOut
from asyncrl.losses.base import ModelOutputs
from asyncrl.losses.vtrace import VTraceLoss, vtrace

PARAMS = [
    dict(discount=1.0, rho_bar=1.0, c_bar=1.0, lam=1.0),
    dict(discount=0.9, rho_bar=1.5, c_bar=0.8, lam=0.7),
    dict(discount=0.5, rho_bar=math.inf, c_bar=math.inf, lam=1.0),
    dict(discount=1.0, rho_bar=0.5, c_bar=2.0, lam=0.0),
]


def random_inputs(B=6, T=7, seed=0, lengths=None, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    lengths = lengths or [0, 1] + torch.randint(2, T + 1, (B - 2,), generator=g).tolist()
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    mu = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    pi = mu + scale * torch.randn(B, T, generator=g, dtype=torch.float64)
    r = torch.randn(B, T, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, generator=g, dtype=torch.float64)
    boot = torch.randn(B, generator=g, dtype=torch.float64)
    return mu, pi, r, v, boot, mask


def rows(x, mask, b):
    return [float(x[b, t]) for t in range(mask.shape[1]) if mask[b, t]]


@pytest.mark.parametrize("reference", [ref_vtrace_row, ref_vtrace_row_recursive])
@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("seed", range(3))
def test_vtrace_matches_paper(reference, params, seed):
    mu, pi, r, v, boot, mask = random_inputs(seed=seed)
    got = vtrace(mu, pi, r, v, boot, mask, **params)
    for b in range(mask.shape[0]):
        vs, pg = reference(
            rows(mu, mask, b),
            rows(pi, mask, b),
            rows(r, mask, b),
            rows(v, mask, b),
            float(boot[b]),
            **params,
        )
        n = len(vs)
        torch.testing.assert_close(
            got.vs[b, :n], torch.tensor(vs, dtype=torch.float64), rtol=1e-12, atol=1e-12
        )
        torch.testing.assert_close(
            got.pg_advantages[b, :n], torch.tensor(pg, dtype=torch.float64), rtol=1e-12, atol=1e-12
        )
    assert torch.all(got.vs[~mask] == 0) and torch.all(got.pg_advantages[~mask] == 0)


def test_on_policy_reduces_to_monte_carlo_returns():
    """lam = discount = 1, pi = mu, rho_bar = c_bar = 1: v_s = sum_{t>=s} r_t + bootstrap and
    the pg advantage is that return minus V(x_s), whatever the values are."""
    mu, _, r, v, boot, mask = random_inputs(seed=4)
    got = vtrace(mu, mu, r, v, boot, mask)
    for b in range(mask.shape[0]):
        rb, vb = rows(r, mask, b), rows(v, mask, b)
        returns = [sum(rb[s:]) + float(boot[b]) for s in range(len(rb))]
        torch.testing.assert_close(got.vs[b, : len(rb)], torch.tensor(returns, dtype=torch.float64))
        adv = [g - val for g, val in zip(returns, vb, strict=True)]
        torch.testing.assert_close(
            got.pg_advantages[b, : len(rb)], torch.tensor(adv, dtype=torch.float64)
        )


def test_on_policy_discounted_n_step_and_td0():
    """On-policy, discount 0.9: lam=1 gives the discounted return bootstrapped with
    gamma^(L-s) V(x_L); lam=0 gives the one-step target r_s + gamma V(x_{s+1})."""
    mu, _, r, v, boot, mask = random_inputs(seed=5)
    full = vtrace(mu, mu, r, v, boot, mask, discount=0.9, rho_bar=3.0, c_bar=3.0, lam=1.0)
    td0 = vtrace(mu, mu, r, v, boot, mask, discount=0.9, lam=0.0)
    for b in range(mask.shape[0]):
        rb, vb = rows(r, mask, b), rows(v, mask, b) + [float(boot[b])]
        L = len(rb)
        n_step = [
            sum(0.9 ** (t - s) * rb[t] for t in range(s, L)) + 0.9 ** (L - s) * vb[L]
            for s in range(L)
        ]
        one_step = [rb[s] + 0.9 * vb[s + 1] for s in range(L)]
        torch.testing.assert_close(full.vs[b, :L], torch.tensor(n_step, dtype=torch.float64))
        torch.testing.assert_close(td0.vs[b, :L], torch.tensor(one_step, dtype=torch.float64))


def test_no_gradient_flows_and_extremes_stay_finite():
    mu, pi, r, v, boot, mask = random_inputs(seed=6)
    pi = (mu + math.log(1e6) * torch.sign(torch.randn_like(mu))).requires_grad_(True)
    v = v.clone().requires_grad_(True)
    for dtype in (torch.float64, torch.float32):
        out = vtrace(
            mu.to(dtype),
            pi.to(dtype),
            r.to(dtype),
            v.to(dtype),
            boot.to(dtype),
            mask,
            rho_bar=math.inf,
            c_bar=math.inf,
        )
        assert not out.vs.requires_grad and not out.pg_advantages.requires_grad
        assert torch.isfinite(out.vs).all() and torch.isfinite(out.pg_advantages).all()


def test_rejects_non_prefix_mask():
    mu, pi, r, v, boot, _ = random_inputs(B=2, T=3)
    with pytest.raises(ValueError, match="prefix"):
        vtrace(mu, pi, r, v, boot, torch.tensor([[True, False, True], [True, True, True]]))


LOSS_CONFIGS = [
    dict(rho_bar=1.0, c_bar=1.0, discount=1.0, lam=1.0, value_coef=0.5, use_value_head=True),
    dict(rho_bar=1.3, c_bar=0.9, discount=0.95, lam=0.8, value_coef=0.25, use_value_head=True),
    dict(rho_bar=1.0, c_bar=1.0, discount=1.0, lam=1.0, value_coef=0.5, use_value_head=False),
    dict(
        rho_bar=1.3,
        c_bar=0.9,
        discount=0.95,
        lam=0.8,
        value_coef=0.5,
        use_value_head=False,
        baseline="from_advantages",
    ),
]


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("cfg", LOSS_CONFIGS)
def test_vtrace_loss_matches_reference(cfg, holes):
    batch, outputs = make_batch(6, 7, seed=11, holes=holes, log_ratio_scale=0.4)
    loss = VTraceLoss(**cfg)
    got = loss(batch, outputs).loss
    want = ref_vtrace_loss(batch, outputs, **cfg)
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-10, atol=1e-12)
    params = [outputs.logprobs] + ([outputs.values] if cfg["use_value_head"] else [])
    for g, w in zip(
        torch.autograd.grad(got, params), torch.autograd.grad(want, params), strict=True
    ):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
        assert torch.all(g[~batch.mask] == 0)


@pytest.mark.parametrize("use_value_head", [True, False])
def test_vtrace_loss_gradcheck(use_value_head):
    """The differentiable part with the (stop-gradient) V-trace targets held fixed."""
    batch, outputs = make_batch(3, 4, seed=3, lengths=[0, 1, 4])
    loss = VTraceLoss(use_value_head=use_value_head, rho_bar=1.2)
    targets = loss.targets(batch, outputs)
    lp, val = (
        outputs.logprobs.detach().clone().requires_grad_(True),
        outputs.values.detach().clone().requires_grad_(True),
    )

    def f(lp, val):
        return loss.loss_from_targets(batch, ModelOutputs(logprobs=lp, values=val), targets).loss

    assert torch.autograd.gradcheck(f, (lp, val) if use_value_head else (lp, val.detach()))


def test_extreme_ratios_loss_finite():
    batch, outputs = make_batch(4, 6, seed=2, lengths=[0, 1, 6, 3], dtype=torch.float32)
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
    lp = (batch.behaviour_logprobs + math.log(1e6) * sign).requires_grad_(True)
    outputs = ModelOutputs(logprobs=lp, values=outputs.values)
    for loss in (VTraceLoss(rho_bar=math.inf, c_bar=math.inf), VTraceLoss(use_value_head=False)):
        out = loss(batch, outputs)
        grads = torch.autograd.grad(out.loss, [lp, outputs.values], allow_unused=True)
        assert torch.isfinite(out.loss) and all(
            torch.isfinite(g).all() for g in grads if g is not None
        )
        assert all(math.isfinite(m) for m in out.metrics.values())


@pytest.mark.parametrize(
    "baseline,estimator", [("group_mean", GroupCentered()), ("from_advantages", LeaveOneOut())]
)
def test_critic_free_on_policy_advantages_are_group_baselined(baseline, estimator):
    """On-policy, lam = discount = 1: every valid token's V-trace advantage is the
    trajectory's reward minus its group baseline (Dr. GRPO's, resp. RLOO's)."""
    batch, outputs = make_batch(8, 5, seed=9, holes=True, n_groups=3)
    seq_adv = estimator(batch.rewards, batch.group_ids)
    batch = dataclasses.replace(
        batch,
        behaviour_logprobs=outputs.logprobs.detach().clone(),
        advantages=seq_adv[:, None].expand(8, 5).clone(),
    )
    ret = VTraceLoss(use_value_head=False, baseline=baseline).targets(batch, outputs)
    want = torch.where(
        batch.mask, seq_adv[:, None].expand(8, 5), torch.zeros((), dtype=torch.float64)
    )
    torch.testing.assert_close(ret.pg_advantages, want)


def test_value_head_on_policy_targets_are_rewards():
    """On-policy, lam = discount = 1, bootstrap 0: v_s is the terminal reward for every s."""
    batch, outputs = make_batch(6, 5, seed=8, holes=True)
    batch.behaviour_logprobs = outputs.logprobs.detach().clone()
    ret = VTraceLoss().targets(batch, outputs)
    want = torch.where(
        batch.mask, batch.rewards[:, None].expand(6, 5), torch.zeros((), dtype=torch.float64)
    )
    torch.testing.assert_close(ret.vs, want)
    torch.testing.assert_close(
        ret.pg_advantages, torch.where(batch.mask, want - outputs.values.detach(), want)
    )
