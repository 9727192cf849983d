"""``learner.optim``: AdamW, the learning-rate schedule, gradient clipping.

The LR at optimizer step ``k`` (0-based) is ``lr * factor(k)``::

    warm-up (k < warmup_steps):  (k + 1) / warmup_steps
    constant:                    1
    cosine:                      min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * p)) / 2,
                                 p = (k - warmup_steps) / (total_steps - warmup_steps), capped at 1

The value head (when on) has its own base LR (``value_lr``) under the same factor.

The off-policy brake (``mismatch_kl_target``, off when null) scales that LR by a factor
in [MIN_LR_SCALE, 1] that it moves before every optimizer step, by the mismatch KL of
the step's batch (``is/mismatch_kl``: the k3 estimate of KL(behaviour || current))::

    scale <- clip(scale * (target / KL) ** KL_GAIN, MIN_LR_SCALE, 1)

so the policy's drift from the versions that generated its data settles near the
target. On-policy the KL is ~0 and the scale stays 1: nothing changes. Under staleness
that drift is what makes importance weights noisy and their truncation biased
(docs/losses.md). The scale is the learner's state (saved in checkpoints).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from asyncrl.learner.config import OptimSettings, Schedule
from asyncrl.learner.dist import global_norm, local, replicas

# The off-policy brake: the log-scale moves by KL_GAIN * log(target / KL) a step (the
# KL answers a change of LR over the next few versions, so the steps are small).
KL_GAIN = 0.05
MIN_LR_SCALE = 0.01


def lr_factor(step: int, s: OptimSettings) -> float:
    """Multiplier of the base LR at optimizer step ``step`` (0-based)."""
    if step < s.warmup_steps:
        return (step + 1) / s.warmup_steps
    if s.schedule is Schedule.CONSTANT:
        return 1.0
    span = max(1, int(s.total_steps) - s.warmup_steps)
    p = min(1.0, (step - s.warmup_steps) / span)
    return s.min_lr_ratio + (1.0 - s.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


def kl_brake(scale: float, kl: float, target: float | None) -> float:
    """The brake's LR multiplier for a step whose batch has mismatch KL ``kl``, from the
    previous one, ``scale`` (1 at the start; always 1 with no target). A NaN KL (broken
    log-probs, which the loss reports itself) leaves it as it was."""
    if target is None:
        return 1.0
    if math.isnan(kl):
        return scale
    nxt = scale * (target / max(kl, 1e-12)) ** KL_GAIN
    return min(1.0, max(MIN_LR_SCALE, nxt))


def build_optimizer(
    policy_params: Iterable[torch.nn.Parameter],
    value_params: Iterable[torch.nn.Parameter],
    s: OptimSettings,
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with one param group for the policy and one for the value head (if any)."""
    groups = [{"params": list(policy_params), "lr": s.lr}]
    value = list(value_params)
    if value:
        groups.append({"params": value, "lr": s.value_lr if s.value_lr is not None else s.lr})
    opt = torch.optim.AdamW(groups, lr=s.lr, weight_decay=s.weight_decay, betas=s.betas)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: lr_factor(k, s))
    return opt, sched


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global grad norm over all ranks (DTensors on any mesh, each element counted once),
    clipping in place when ``max_norm > 0``. Returns the norm before clipping (a plain
    float64 scalar tensor, the same on every rank)."""
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return torch.zeros(())
    norm = global_norm([p.grad for p in with_grad], [replicas(p) for p in with_grad])
    if max_norm > 0:
        coef = min(1.0, max_norm / (float(norm) + 1e-6))  # torch's clip_grads_with_norm_
        if coef < 1.0:
            with torch.no_grad():
                torch._foreach_mul_([local(p.grad) for p in with_grad], coef)
    return norm
