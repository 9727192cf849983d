"""Masked importance sampling (MIS, IcePop-style): drop what is too far off-policy.

Tokens (``level="token"``) or whole sequences (``level="sequence"``) whose ratio
leaves ``[low, high]`` contribute nothing; the rest get the plain, untruncated
IS-weighted policy gradient::

    loss = sum_{b,t} w[b,t] * keep[b,t] * -(stopgrad(rho) * A[b,t] * logp[b,t])

Token level: ``rho = pi/mu`` per token. Sequence level: ``rho`` is the geometric mean
of the sequence's token ratios, ``exp(mean_t log pi/mu)``, used both to decide and as
the weight of every kept token (a product would make long sequences always fall out
of the band). Unlike truncation, masking adds no bias to the kept tokens' weights;
it trades it for discarding data the sampler and learner disagree on (e.g. an
inference-engine numeric mismatch).
"""

from __future__ import annotations

import torch

from asyncrl.losses.base import LossBatch, LossOutput, ModelOutputs, masked_mean, weighted_sum
from asyncrl.losses.diagnostics import is_diagnostics
from asyncrl.losses.ratios import LOG_RATIO_CAP, check_level, log_ratio, safe_log, sequence_mean


class MaskedISLoss:
    """Band-masked IS policy gradient. Metrics: ``is/*`` and ``is/mask_frac`` (fraction
    of valid tokens masked out)."""

    needs_proximal = False
    needs_values = False

    def __init__(self, level: str = "token", low: float = 0.5, high: float = 2.0):
        check_level(level)
        if not 0 <= low <= 1 <= high:
            raise ValueError(
                f"loss.low/loss.high must satisfy 0 <= low <= 1 <= high, got {low}, {high}"
            )
        self.level = level
        self.low = float(low)
        self.high = float(high)

    def weights(self, batch: LossBatch, outputs: ModelOutputs) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, T]`` IS weights (0 where masked) and the bool ``[B, T]`` keep map."""
        with torch.no_grad():
            lr = log_ratio(outputs.logprobs.detach(), batch.behaviour_logprobs, batch.mask)
            if self.level == "sequence":
                lr = sequence_mean(lr, batch.mask).expand_as(lr)
            # Compare in log space so that the band edges are exact and nothing overflows.
            keep = (lr >= safe_log(self.low)) & (lr <= safe_log(self.high)) & batch.mask
            w = torch.where(keep, lr.clamp(max=LOG_RATIO_CAP).exp(), torch.zeros_like(lr))
            return w, keep

    def __call__(self, batch: LossBatch, outputs: ModelOutputs) -> LossOutput:
        w, keep = self.weights(batch, outputs)
        per_token = -(w * batch.advantages.to(w.dtype)) * outputs.logprobs
        metrics = is_diagnostics(batch, outputs)
        metrics["is/mask_frac"] = float(masked_mean((~keep).float(), batch.mask))
        return LossOutput(loss=weighted_sum(per_token, batch), metrics=metrics)
