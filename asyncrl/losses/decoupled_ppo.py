"""Decoupled PPO (Hilton et al. 2022; AReaL's asynchronous objective).

Three policies: the behaviour policy ``mu`` that sampled (vLLM, possibly several
versions old), the proximal policy ``pi_prox`` (the learner's weights at the start of
this step, recomputed without gradient) and the current policy ``pi`` being trained.
The trust region is measured against ``pi_prox``, not the stale ``mu``; the
off-policyness of the data is corrected by a separate, truncated, constant weight::

    r   = pi / pi_prox                                   (with gradient)
    s   = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)
    loss = sum_{b,t} w[b,t] * stopgrad(min(pi_prox / mu, behaviour_cap)) * s[b,t]

With ``pi_prox == mu`` this is ``ClippedISLoss``; on-policy its gradient is the plain
policy gradient.

``level="sequence"`` makes the behaviour weight the sequence's: the product of its
tokens' ``pi_prox / mu`` (``exp`` of their summed log-ratios), truncated at
``behaviour_cap`` and shared by all its tokens, as ``TISLoss(level="sequence")`` does.
That is the exact importance weight of a whole answer under a sequence-level reward,
where the token level ignores how the earlier tokens' odds moved; its variance grows
with the length, so it suits short answers (the default task's are 2-3 tokens).

``proximal="loglinear"`` replaces the recomputed ``pi_prox`` by AReaL's log-linear
approximation from the tokens' versions (:mod:`asyncrl.losses.proximal`); the loss then
declares ``needs_proximal = False`` and the learner skips that forward pass.
"""

from __future__ import annotations

import torch

from asyncrl.losses.base import LossBatch, LossOutput, ModelOutputs, masked_mean, weighted_sum
from asyncrl.losses.diagnostics import is_diagnostics
from asyncrl.losses.proximal import check_proximal, proximal_logprobs
from asyncrl.losses.ratios import (
    LOG_RATIO_CAP,
    check_level,
    log_ratio,
    safe_log,
    sequence_sum,
    truncated_exp,
)


class DecoupledPPOLoss:
    """Metrics: ``is/*``, ``is/clip_frac`` (tokens where the clipped term is active),
    ``is/behaviour_clip_frac`` (tokens whose ``pi_prox/mu`` was truncated) and, with
    ``proximal="loglinear"``, ``is/proximal_alpha_mean``.

    ``needs_proximal`` is an instance attribute: True only for ``proximal="recompute"``."""

    needs_proximal = True
    needs_values = False

    def __init__(
        self,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        behaviour_cap: float = 5.0,
        level: str = "token",
        proximal: str = "recompute",
    ):
        check_level(level)
        self.proximal = check_proximal(proximal)
        self.needs_proximal = proximal == "recompute"
        if not 0 <= clip_low < 1 or clip_high < 0:
            raise ValueError(
                f"loss.clip_low must be in [0, 1) and loss.clip_high >= 0, got {clip_low}, {clip_high}"
            )
        if not behaviour_cap > 0:
            raise ValueError(f"loss.behaviour_cap must be > 0, got {behaviour_cap}")
        self.clip_low = float(clip_low)
        self.clip_high = float(clip_high)
        self.behaviour_cap = float(behaviour_cap)
        self.level = level

    def __call__(self, batch: LossBatch, outputs: ModelOutputs) -> LossOutput:
        prox, prox_metrics = proximal_logprobs(batch, outputs, self.proximal, "DecoupledPPOLoss")
        mask = batch.mask
        with torch.no_grad():
            behaviour_lr = log_ratio(prox, batch.behaviour_logprobs, mask)
            if self.level == "sequence":
                behaviour_lr = sequence_sum(behaviour_lr, mask).expand_as(behaviour_lr)
            behaviour_w = truncated_exp(behaviour_lr, self.behaviour_cap)
        ratio = log_ratio(outputs.logprobs, prox, mask).clamp(max=LOG_RATIO_CAP).exp()
        adv = batch.advantages.to(ratio.dtype)
        unclipped = ratio * adv
        clipped = ratio.clamp(1 - self.clip_low, 1 + self.clip_high) * adv
        per_token = -torch.minimum(unclipped, clipped) * behaviour_w
        metrics = {**is_diagnostics(batch, outputs), **prox_metrics}
        with torch.no_grad():
            metrics["is/clip_frac"] = float(masked_mean((clipped < unclipped).float(), mask))
            over = behaviour_lr > safe_log(self.behaviour_cap)
            metrics["is/behaviour_clip_frac"] = float(masked_mean(over.float(), mask))
        return LossOutput(loss=weighted_sum(per_token, batch), metrics=metrics)
