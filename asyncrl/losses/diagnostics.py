"""Importance-sampling diagnostics logged for every loss (``is/*`` metric names).

All statistics are over valid tokens and computed without gradient. ``ratio`` is
``exp(current - behaviour)``; the k3 estimator of KL(behaviour || current) is
``E_behaviour[r - 1 - log r]`` with ``r = exp(current - behaviour)`` (Schulman's
unbiased, non-negative estimator).
"""

from __future__ import annotations

import torch

from asyncrl.losses.base import LossBatch, ModelOutputs, masked_mean
from asyncrl.losses.ratios import LOG_RATIO_CAP, log_ratio

# Staleness buckets for the split metrics: 0, 1, 2-3, 4-7, 8+ (powers of two, so the
# buckets stay few and readable whatever max_staleness is).
STALENESS_BUCKETS = ((0, 0, "0"), (1, 1, "1"), (2, 3, "2-3"), (4, 7, "4-7"), (8, 1 << 62, "8+"))


def k3_terms(log_ratio: torch.Tensor) -> torch.Tensor:
    """``r - 1 - log r`` per token, ``r = exp(log_ratio)``: the k3 terms of KL(behaviour ||
    current) when ``log_ratio = current - behaviour``."""
    return log_ratio.exp() - 1 - log_ratio


@torch.no_grad()
def mismatch_kl_sum(current: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor):
    """``[k3 sum, tokens]`` over ``mask`` in float64 (``is/mismatch_kl`` is their ratio):
    what the learner's off-policy brake sums over micro-batches and ranks."""
    lr = log_ratio(current.detach(), behaviour, mask).double().clamp(max=LOG_RATIO_CAP)
    return torch.stack([k3_terms(lr).sum(), mask.sum().double()]).cpu()


def _stats(log_ratio: torch.Tensor, mask: torch.Tensor, prefix: str) -> dict[str, float]:
    n = int(mask.sum())
    if n == 0:
        return {}
    lr = torch.where(mask, log_ratio, torch.zeros_like(log_ratio)).double()
    ratio = lr.exp()
    valid = ratio[mask]
    # ESS fraction: (sum w)^2 / (n * sum w^2), in (0, 1]; 1 means on-policy.
    ess = float(valid.sum() ** 2 / (n * (valid**2).sum()).clamp(min=1e-300))
    k3 = masked_mean(k3_terms(lr), mask)
    return {
        f"{prefix}ratio_mean": float(valid.mean()),
        f"{prefix}ratio_max": float(valid.max()),
        f"{prefix}ess": ess,
        f"{prefix}mismatch_kl": float(k3),
        f"{prefix}mismatch_abs_max": float(lr[mask].abs().max()),
    }


@torch.no_grad()
def is_diagnostics(batch: LossBatch, outputs: ModelOutputs) -> dict[str, float]:
    """``is/ratio_mean``, ``is/ratio_max``, ``is/ess``, ``is/mismatch_kl`` and the same per
    staleness bucket (``is/staleness_<bucket>/...``)."""
    log_ratio = outputs.logprobs.detach() - batch.behaviour_logprobs
    out = _stats(log_ratio, batch.mask, "is/")
    stale = batch.staleness
    for lo, hi, name in STALENESS_BUCKETS:
        rows = (stale >= lo) & (stale <= hi)
        if rows.any():
            out.update(_stats(log_ratio, batch.mask & rows[:, None], f"is/staleness_{name}/"))
    return out
