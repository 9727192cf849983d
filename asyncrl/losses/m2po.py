"""M2PO: bound the second moment of the log importance ratio by dropping its largest
terms (Zheng et al. 2025, "Prosperity before Collapse: How Far Can Off-Policy RL Reach
with Stale Data on LLMs?", arXiv 2510.01161; AReaL's ``m2_threshold``).

Per valid token ``m2 = (log pi/mu)^2``. The tokens with the largest ``m2`` are dropped,
one at a time, until the mean ``m2`` of the rest is below ``threshold`` (strictly; at
least one token is always kept). The rest get the unclipped IS-weighted policy
gradient::

    loss = sum_{b,t} w * keep * -(rho A),   rho = pi / mu   (with gradient)

Only outliers go: on stale data whose ratios are all moderate nothing is dropped, where
a PPO clip would cut every token past ``1 +- eps``. Ties in ``m2`` are broken by the
token's position (row-major): the later one is dropped first.

The mask is decided over the tokens the loss sees in one call, i.e. per micro-batch on
each rank, as AReaL does: unlike the other losses its value depends on the
micro-batching (``learner.micro_batch_tokens``) and the world size.
"""

from __future__ import annotations

import torch

from asyncrl.losses.base import LossBatch, LossOutput, ModelOutputs, masked_mean, weighted_sum
from asyncrl.losses.diagnostics import is_diagnostics
from asyncrl.losses.ratios import LOG_RATIO_CAP, log_ratio


@torch.no_grad()
def second_moment_keep(m2: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """Bool ``[B, T]``: the valid tokens kept when the largest ``m2`` are dropped until the
    mean of the rest is ``< threshold`` (all dropped but the smallest if none is)."""
    flat = m2.reshape(-1)
    valid = mask.reshape(-1).nonzero().squeeze(1)
    keep = torch.zeros_like(flat, dtype=torch.bool)
    n = valid.numel()
    if n == 0:
        return keep.view_as(mask)
    vals = flat[valid].double()
    order = torch.sort(vals, stable=True).indices  # ascending; ties keep row-major order
    means = vals[order].cumsum(0) / torch.arange(1, n + 1, dtype=torch.float64)
    ok = (means < threshold).nonzero()
    kept = int(ok.max()) + 1 if ok.numel() else 1
    keep[valid[order[:kept]]] = True
    return keep.view_as(mask)


class M2POLoss:
    """Metrics: ``is/*``, ``is/masked_fraction`` (valid tokens dropped), ``is/m2`` and
    ``is/m2_kept`` (mean ``(log pi/mu)^2`` over the valid and over the kept tokens)."""

    needs_proximal = False
    needs_values = False

    def __init__(self, threshold: float = 0.04):
        if not threshold > 0:
            raise ValueError(f"loss.threshold must be > 0, got {threshold}")
        self.threshold = float(threshold)

    def __call__(self, batch: LossBatch, outputs: ModelOutputs) -> LossOutput:
        lr = log_ratio(outputs.logprobs, batch.behaviour_logprobs, batch.mask)
        with torch.no_grad():
            m2 = lr.detach().square()
            keep = second_moment_keep(m2, batch.mask, self.threshold)
        rho = lr.clamp(max=LOG_RATIO_CAP).exp()
        pg = torch.where(keep, rho * batch.advantages.to(rho.dtype), torch.zeros_like(rho))
        metrics = is_diagnostics(batch, outputs)
        metrics["is/masked_fraction"] = float(masked_mean((~keep).float(), batch.mask))
        metrics["is/m2"] = float(masked_mean(m2, batch.mask))
        metrics["is/m2_kept"] = float(masked_mean(m2, keep))
        return LossOutput(loss=weighted_sum(-pg, batch), metrics=metrics)
