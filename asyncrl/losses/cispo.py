"""CISPO: clipped-weight REINFORCE anchored on the rollout policy (MiniMax-M1,
arXiv 2506.13585; verl's ``compute_policy_loss_cispo``).

PPO's clip removes the gradient of every token whose ratio left the trust region, and
the rare "fork" tokens of a reasoning trace are the ones that leave it first. CISPO
clips the *importance weight* instead and keeps every token's gradient::

    rho  = pi / mu                                            (mu: the sampler)
    loss = sum_{b,t} w * -( sg(clip(rho, 1 - clip_low, 1 + clip_high)) * A * logp )

MiniMax-M1 sets no lower bound (``clip_low = 1``: weights in ``[0, 1 + clip_high]``)
and tunes only the upper one; with ``clip_low = 1`` this is ``TISLoss`` (token level)
with ``cap = 1 + clip_high``. The clip is taken in log space, so a bound exactly at a
ratio keeps the ratio.
"""

from __future__ import annotations

import math

import torch

from asyncrl.losses.base import LossBatch, LossOutput, ModelOutputs
from asyncrl.losses.ratios import LOG_RATIO_CAP, log_ratio, safe_log
from asyncrl.losses.tis import weighted_reinforce


class CISPOLoss:
    """Metrics: ``is/*`` and ``is/clip_frac`` (valid tokens whose weight was clipped,
    above or below)."""

    needs_proximal = False
    needs_values = False

    def __init__(self, clip_low: float = 1.0, clip_high: float = 0.28):
        if not 0 <= clip_low <= 1 or not clip_high >= 0:
            raise ValueError(
                f"loss.clip_low must be in [0, 1] and loss.clip_high >= 0, got {clip_low}, {clip_high}"
            )
        self.clip_low = float(clip_low)
        self.clip_high = float(clip_high)

    def weights(self, batch: LossBatch, outputs: ModelOutputs) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, T]`` clipped weights and the bool ``[B, T]`` "was clipped" map."""
        with torch.no_grad():
            lr = log_ratio(outputs.logprobs.detach(), batch.behaviour_logprobs, batch.mask)
            lo = safe_log(1 - self.clip_low)
            hi = min(math.log1p(self.clip_high), LOG_RATIO_CAP)
            clipped = ((lr < lo) | (lr > hi)) & batch.mask
            return lr.clamp(min=lo, max=hi).exp(), clipped

    def __call__(self, batch: LossBatch, outputs: ModelOutputs) -> LossOutput:
        return weighted_reinforce(batch, outputs, *self.weights(batch, outputs))
