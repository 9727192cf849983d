"""Importance-ratio helpers shared by the built-in losses.

Every ratio is formed in log space and exponentiated only after truncation, so a
ratio of 1e6 or 1e-6 (log-ratio of about +-13.8) can never become inf, 0/0 or NaN.
Padding positions (``mask == False``) are zeroed in log space before any sum.
"""

from __future__ import annotations

import math

import torch

# exp(20) ~ 5e8: beyond any sane importance weight, far below float32's overflow
# (exp(88)). Only used where no user cap bounds the exponent.
LOG_RATIO_CAP = 20.0


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """At least float32: bf16 log-ratios lose the digits a ratio near 1 lives in."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def log_ratio(num: torch.Tensor, den: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` ``log(num / den)`` from log-probs; 0 on padding. Keeps ``num``'s graph."""
    dtype = compute_dtype(num, den)
    lr = num.to(dtype) - den.to(dtype)
    return torch.where(mask, lr, torch.zeros_like(lr))


def sequence_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T] -> [B, 1]`` sum over valid tokens (0 for an empty row)."""
    return torch.where(mask, x, torch.zeros_like(x)).sum(dim=1, keepdim=True)


def sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T] -> [B, 1]`` mean over valid tokens (0 for an empty row)."""
    n = mask.sum(dim=1, keepdim=True).clamp(min=1)
    return sequence_sum(x, mask) / n


LEVELS = ("token", "sequence")  # where an importance weight is formed: per token or per answer


def check_level(level: str) -> str:
    """``loss.level`` as given, or a ValueError naming the key."""
    if level not in LEVELS:
        raise ValueError(f"loss.level must be one of {LEVELS}, got {level!r}")
    return level


def safe_log(x: float) -> float:
    """``log`` of a non-negative threshold, with ``log(0) = -inf`` and ``log(inf) = inf``."""
    if x < 0:
        raise ValueError(f"threshold must be >= 0, got {x}")
    return -math.inf if x == 0 else math.log(x)


def truncated_exp(log_w: torch.Tensor, cap: float) -> torch.Tensor:
    """``min(exp(log_w), cap)`` computed as ``exp(min(log_w, log cap))`` (never overflows)."""
    return log_w.clamp(max=min(safe_log(cap), LOG_RATIO_CAP)).exp()
