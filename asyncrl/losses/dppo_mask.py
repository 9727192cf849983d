"""DPPO-style binary divergence masks (prime-rl's default loss).

Follows prime-rl's ``default_loss_fn`` (src/prime_rl/trainer/rl/loss.py in
PrimeIntellect-ai/prime-rl: "DPPO-Binary TV", arXiv 2602.04879, plus a Kimi-K2.5-style
squared log-ratio penalty). Each token's divergence between the behaviour policy ``mu``
and the current policy ``pi`` is measured on the *binary* distribution "this token or
not" (``p = exp(logp)``, ``q = exp(mu)``):

* ``divergence="tv"``: ``|p - q|`` (the binary total variation);
* ``divergence="kl"``: ``q log(q/p) + (1-q) log((1-q)/(1-p))`` (binary KL(mu || pi)).

A token is dropped when it moved too far *in the direction its advantage pushes*:
``A > 0`` and ``p > q`` with divergence ``> high``, or ``A <= 0`` and ``p < q`` with
divergence ``> low`` (a divergence exactly at the threshold is kept). The kept tokens get
the IS-weighted policy gradient, every valid token the penalty::

    loss = sum_{b,t} w * ( -keep * rho * A + kl_coef * (log rho)^2 ),  rho = pi / mu

``rho`` carries the gradient (``d rho = rho d logp``). Unlike PPO's clip, which only
removes the gradient of tokens that moved past the bound, the mask is decided on the
probability change, so a rare token's large ratio is not dropped unless its probability
moved by ``high`` in absolute terms.
"""

from __future__ import annotations

import torch

from asyncrl.losses.base import LossBatch, LossOutput, ModelOutputs, masked_mean, weighted_sum
from asyncrl.losses.diagnostics import is_diagnostics, k3_terms
from asyncrl.losses.ratios import LOG_RATIO_CAP, log_ratio

DIVERGENCES = ("tv", "kl")


def binary_divergence(logp: torch.Tensor, mu: torch.Tensor, kind: str) -> torch.Tensor:
    """``[B, T]`` binary TV ``|p - q|`` or binary KL(q || p), ``p = exp(logp)``,
    ``q = exp(mu)``; no gradient. The KL's ``1 - p`` is formed as ``-expm1(logp)`` and
    floored at the smallest normal number, so ``p = 1`` gives a large finite value."""
    with torch.no_grad():
        p, q = logp.exp(), mu.exp()
        if kind == "tv":
            return (p - q).abs()
        tiny = torch.finfo(logp.dtype).tiny
        not_p, not_q = (-torch.expm1(logp)).clamp(min=tiny), (-torch.expm1(mu)).clamp(min=tiny)
        return q * (mu - logp) + not_q * (not_q.log() - not_p.log())


class DPPOMaskLoss:
    """Metrics: ``is/*``, ``is/masked_fraction`` (valid tokens dropped),
    ``is/masked_fraction_high`` / ``is/masked_fraction_low`` (dropped with ``A > 0`` /
    ``A <= 0``), ``is/masked_mismatch_kl`` / ``is/unmasked_mismatch_kl`` (k3 KL over the
    dropped / kept tokens, 0 when there are none)."""

    needs_proximal = False
    needs_values = False

    def __init__(
        self, divergence: str = "tv", low: float = 0.2, high: float = 0.2, kl_coef: float = 1e-3
    ):
        if divergence not in DIVERGENCES:
            raise ValueError(f"loss.divergence must be one of {DIVERGENCES}, got {divergence!r}")
        if not (low >= 0 and high >= 0):
            raise ValueError(f"loss.low and loss.high must be >= 0, got {low}, {high}")
        if not kl_coef >= 0:
            raise ValueError(f"loss.kl_coef must be >= 0, got {kl_coef}")
        self.divergence = divergence
        self.low = float(low)
        self.high = float(high)
        self.kl_coef = float(kl_coef)

    def masks(self, batch: LossBatch, outputs: ModelOutputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Bool ``[B, T]`` maps of the valid tokens dropped with ``A > 0`` and with ``A <= 0``."""
        with torch.no_grad():
            lp = outputs.logprobs.detach()
            mu = batch.behaviour_logprobs.to(lp.dtype)
            div = binary_divergence(lp, mu, self.divergence)
            positive = batch.advantages > 0
            high = batch.mask & positive & (lp > mu) & (div > self.high)
            low = batch.mask & ~positive & (lp < mu) & (div > self.low)
            return high, low

    def __call__(self, batch: LossBatch, outputs: ModelOutputs) -> LossOutput:
        high, low = self.masks(batch, outputs)
        dropped = high | low
        lr = log_ratio(outputs.logprobs, batch.behaviour_logprobs, batch.mask)
        rho = lr.clamp(max=LOG_RATIO_CAP).exp()
        pg = torch.where(dropped, torch.zeros_like(rho), rho * batch.advantages.to(rho.dtype))
        per_token = -pg + self.kl_coef * lr.square()
        metrics = is_diagnostics(batch, outputs)
        with torch.no_grad():
            k3 = k3_terms(lr.detach().clamp(max=LOG_RATIO_CAP))
            metrics["is/masked_fraction"] = float(masked_mean(dropped.float(), batch.mask))
            metrics["is/masked_fraction_high"] = float(masked_mean(high.float(), batch.mask))
            metrics["is/masked_fraction_low"] = float(masked_mean(low.float(), batch.mask))
            metrics["is/masked_mismatch_kl"] = float(masked_mean(k3, dropped))
            metrics["is/unmasked_mismatch_kl"] = float(masked_mean(k3, batch.mask & ~dropped))
        return LossOutput(loss=weighted_sum(per_token, batch), metrics=metrics)
