"""IcePop: PPO against the learner's own old policy, with the trainer/sampler mismatch
masked on both sides (Ling Team, "Every Step Evolves: Scaling Reinforcement Learning for
Trillion-Scale Thinking Model", the Ring-1T report).

The PPO surrogate is taken against the proximal policy ``pi_prox`` (the learner's
weights at the start of the batch); the gap between the learner's and the sampler's
probabilities of the same token, ``kappa = pi_prox / mu``, is a constant weight inside
the band ``[low, high]`` and drops the token outside it::

    r   = pi / pi_prox                                  (with gradient)
    s   = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)
    loss = sum_{b,t} w * [low <= kappa <= high] * sg(kappa) * s

This is :class:`~asyncrl.losses.decoupled_ppo.DecoupledPPOLoss` with its truncation
of ``pi_prox / mu`` replaced by masking (no bias on the kept tokens; the band edges
belong to the band). ``MaskedISLoss`` is the single-policy form: a band on ``pi / mu``
and no PPO clip. ``proximal="loglinear"`` approximates ``pi_prox`` from the tokens'
versions instead of a forward pass (:mod:`asyncrl.losses.proximal`).
"""

from __future__ import annotations

import torch

from asyncrl.losses.base import LossBatch, LossOutput, ModelOutputs, masked_mean, weighted_sum
from asyncrl.losses.diagnostics import is_diagnostics
from asyncrl.losses.proximal import check_proximal, proximal_logprobs
from asyncrl.losses.ratios import LOG_RATIO_CAP, log_ratio, safe_log


class IcePopLoss:
    """Metrics: ``is/*``, ``is/masked_fraction`` (valid tokens whose ``pi_prox/mu`` left
    the band), ``is/clip_frac`` (valid tokens where the clipped term is active) and, with
    ``proximal="loglinear"``, ``is/proximal_alpha_mean``.

    ``needs_proximal`` is an instance attribute: True only for ``proximal="recompute"``."""

    needs_proximal = True
    needs_values = False

    def __init__(
        self,
        low: float = 0.5,
        high: float = 5.0,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        proximal: str = "recompute",
    ):
        if not 0 <= low <= 1 <= high:
            raise ValueError(
                f"loss.low/loss.high must satisfy 0 <= low <= 1 <= high, got {low}, {high}"
            )
        if not 0 <= clip_low < 1 or clip_high < 0:
            raise ValueError(
                f"loss.clip_low must be in [0, 1) and loss.clip_high >= 0, got {clip_low}, {clip_high}"
            )
        self.proximal = check_proximal(proximal)
        self.needs_proximal = proximal == "recompute"
        self.low = float(low)
        self.high = float(high)
        self.clip_low = float(clip_low)
        self.clip_high = float(clip_high)

    def __call__(self, batch: LossBatch, outputs: ModelOutputs) -> LossOutput:
        prox, prox_metrics = proximal_logprobs(batch, outputs, self.proximal, "IcePopLoss")
        mask = batch.mask
        with torch.no_grad():
            kappa_lr = log_ratio(prox, batch.behaviour_logprobs, mask)
            keep = (kappa_lr >= safe_log(self.low)) & (kappa_lr <= safe_log(self.high)) & mask
            kappa = torch.where(keep, kappa_lr.exp(), torch.zeros_like(kappa_lr))
        ratio = log_ratio(outputs.logprobs, prox, mask).clamp(max=LOG_RATIO_CAP).exp()
        adv = batch.advantages.to(ratio.dtype)
        unclipped = ratio * adv
        clipped = ratio.clamp(1 - self.clip_low, 1 + self.clip_high) * adv
        per_token = -torch.minimum(unclipped, clipped) * kappa
        metrics = {**is_diagnostics(batch, outputs), **prox_metrics}
        with torch.no_grad():
            metrics["is/masked_fraction"] = float(masked_mean((~keep).float(), mask))
            metrics["is/clip_frac"] = float(masked_mean((clipped < unclipped).float(), mask))
        return LossOutput(loss=weighted_sum(per_token, batch), metrics=metrics)
