"""Truncated importance sampling (TIS) on the REINFORCE term.

Per valid token ``t`` of sequence ``b``::

    loss = sum_{b,t} w[b,t] * -(stopgrad(min(rho, cap)) * A[b,t] * logp[b,t])

with ``rho = pi/mu`` per token (``level="token"``) or the product of the sequence's
token ratios, ``exp(sum_t log pi/mu)``, shared by all its tokens (``level="sequence"``).
The weight is a constant for autograd, so the gradient is the truncated-IS policy
gradient ``-sum w * min(rho, cap) * A * grad logp``. Truncation bounds the variance
at the price of a bias towards the behaviour policy (Ionides 2008; Espeholt et al.
2018, the same trick as V-trace's ``rho_bar``).
"""

from __future__ import annotations

import torch

from asyncrl.losses.base import LossBatch, LossOutput, ModelOutputs, masked_mean, weighted_sum
from asyncrl.losses.diagnostics import is_diagnostics
from asyncrl.losses.ratios import check_level, log_ratio, safe_log, sequence_sum, truncated_exp


class TISLoss:
    """Truncated-IS policy gradient. Metrics: ``is/*`` and ``is/clip_frac`` (fraction of
    valid tokens whose weight was truncated; at sequence level a truncated sequence
    counts all its tokens)."""

    needs_proximal = False
    needs_values = False

    def __init__(self, level: str = "token", cap: float = 2.0):
        check_level(level)
        if not cap > 0:
            raise ValueError(f"loss.cap must be > 0, got {cap}")
        self.level = level
        self.cap = float(cap)

    def weights(self, batch: LossBatch, outputs: ModelOutputs) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, T]`` truncated weights and the bool ``[B, T]`` "was truncated" map."""
        with torch.no_grad():
            lr = log_ratio(outputs.logprobs.detach(), batch.behaviour_logprobs, batch.mask)
            if self.level == "sequence":
                lr = sequence_sum(lr, batch.mask).expand_as(lr)
            return truncated_exp(lr, self.cap), lr > safe_log(self.cap)

    def __call__(self, batch: LossBatch, outputs: ModelOutputs) -> LossOutput:
        return weighted_reinforce(batch, outputs, *self.weights(batch, outputs))


def weighted_reinforce(
    batch: LossBatch, outputs: ModelOutputs, w: torch.Tensor, clipped: torch.Tensor
) -> LossOutput:
    """REINFORCE with fixed per-token weights ``w`` ``[B, T]`` (no gradient through
    them): ``-w * A * log pi``; ``clipped`` ``[B, T]`` bool gives ``is/clip_frac``."""
    per_token = -(w * batch.advantages.to(w.dtype)) * outputs.logprobs
    metrics = is_diagnostics(batch, outputs)
    metrics["is/clip_frac"] = float(masked_mean(clipped.float(), batch.mask))
    return LossOutput(loss=weighted_sum(per_token, batch), metrics=metrics)
