"""GSPO: PPO's clip on a sequence-level ratio (Qwen, "Group Sequence Policy
Optimization", arXiv 2507.18071; verl's ``compute_policy_loss_gspo``).

The ratio of a whole answer ``y`` of ``|y|`` valid tokens is the geometric mean of its
token ratios against the sampler, ``s = exp(mean_t log(pi/mu))``, and every token of
the answer shares it. Per token it is written so that its value is ``s`` and its
gradient ``s * grad logp_t``::

    s_t  = sg(s) * exp(logp_t - sg(logp_t))
    loss = sum_{b,t} w * -min(s_t A, clip(s_t, 1 - clip_low, 1 + clip_high) A)

so a clipped answer gives none of its tokens a gradient, and an answer is clipped or
not as a whole. The paper's bounds are tiny (3e-4, 4e-4): the geometric mean moves far
less than a token's ratio. Against stale samples (``mu`` several versions old) they
clip most answers, so GSPO suits data close to on-policy (small ``max_staleness``,
``learner.minibatches > 1``). The reduction is the learner's ``loss_weights`` (the
paper and verl average tokens within a sequence, then sequences); an empty row
contributes nothing.
"""

from __future__ import annotations

import torch

from asyncrl.losses.base import LossBatch, LossOutput, ModelOutputs, masked_mean, weighted_sum
from asyncrl.losses.diagnostics import is_diagnostics
from asyncrl.losses.ratios import LOG_RATIO_CAP, log_ratio, sequence_mean


class GSPOLoss:
    """Metrics: ``is/*``, ``is/clip_frac`` (valid tokens whose answer's clipped term is
    active) and ``is/seq_ratio_mean`` (mean ``s`` over the non-empty answers)."""

    needs_proximal = False
    needs_values = False

    def __init__(self, clip_low: float = 3e-4, clip_high: float = 4e-4):
        if not 0 <= clip_low < 1 or clip_high < 0:
            raise ValueError(
                f"loss.clip_low must be in [0, 1) and loss.clip_high >= 0, got {clip_low}, {clip_high}"
            )
        self.clip_low = float(clip_low)
        self.clip_high = float(clip_high)

    def __call__(self, batch: LossBatch, outputs: ModelOutputs) -> LossOutput:
        mask = batch.mask
        lr = log_ratio(outputs.logprobs, batch.behaviour_logprobs, mask)
        seq_lr = sequence_mean(lr.detach(), mask)  # [B, 1], no gradient
        logp = log_ratio(outputs.logprobs, torch.zeros_like(batch.behaviour_logprobs), mask)
        # exp(0) == 1 exactly: the value is exp(log s) to the last bit, the gradient s.
        s = seq_lr.clamp(max=LOG_RATIO_CAP).exp() * (logp - logp.detach()).exp()
        adv = batch.advantages.to(s.dtype)
        unclipped = s * adv
        clipped = s.clamp(1 - self.clip_low, 1 + self.clip_high) * adv
        per_token = -torch.minimum(unclipped, clipped)
        metrics = is_diagnostics(batch, outputs)
        with torch.no_grad():
            metrics["is/clip_frac"] = float(masked_mean((clipped < unclipped).float(), mask))
            rows = mask.any(dim=1)
            if rows.any():
                seq_ratio = seq_lr[rows].clamp(max=LOG_RATIO_CAP).exp()
                metrics["is/seq_ratio_mean"] = float(seq_ratio.mean())
        return LossOutput(loss=weighted_sum(per_token, batch), metrics=metrics)
