"""Clipped importance-ratio loss against the behaviour policy (PPO's surrogate with the
vLLM sampling policy as the "old" policy). The training job's default loss
(conf/loss/clipped.yaml)."""

from __future__ import annotations

import torch

from asyncrl.losses.base import LossBatch, LossOutput, ModelOutputs, masked_mean, weighted_sum
from asyncrl.losses.diagnostics import is_diagnostics


class ClippedISLoss:
    """``-min(r A, clip(r, 1-eps_low, 1+eps_high) A)`` with ``r = pi/mu`` per token.

    The ratio is formed in log space and the exponent clamped at ``log_ratio_cap`` so
    that a 1e6 ratio cannot overflow into inf/NaN gradients.
    """

    needs_proximal = False
    needs_values = False

    def __init__(self, clip_low: float = 0.2, clip_high: float = 0.2, log_ratio_cap: float = 20.0):
        if clip_low < 0 or clip_high < 0:
            raise ValueError(f"clip_low/clip_high must be >= 0, got {clip_low}, {clip_high}")
        self.clip_low = clip_low
        self.clip_high = clip_high
        self.log_ratio_cap = log_ratio_cap

    def __call__(self, batch: LossBatch, outputs: ModelOutputs) -> LossOutput:
        log_ratio = (outputs.logprobs - batch.behaviour_logprobs).clamp(max=self.log_ratio_cap)
        ratio = log_ratio.exp()
        adv = batch.advantages
        unclipped = ratio * adv
        clipped = ratio.clamp(1 - self.clip_low, 1 + self.clip_high) * adv
        per_token = -torch.minimum(unclipped, clipped)
        loss = weighted_sum(per_token, batch)
        metrics = is_diagnostics(batch, outputs)
        with torch.no_grad():
            metrics["is/clip_frac"] = float(masked_mean((clipped < unclipped).float(), batch.mask))
        return LossOutput(loss=loss, metrics=metrics)
