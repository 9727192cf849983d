"""Advantage estimators over groups (trajectories sampled from one prompt).

Each is a callable ``(rewards [B], group_ids [B]) -> advantages [B]``, built from
``_target_`` like every other plug-in.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Advantage(Protocol):
    """``(rewards [B] float64, group_ids [B] int64) -> advantages [B]``; a group is the
    trajectories sampled from one prompt."""

    def __call__(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor: ...


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor):
    _, inv, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, inv, rewards)
    means = sums / counts
    sq = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(
        0, inv, (rewards - means[inv]) ** 2
    )
    return inv, counts, sums, means, sq


class GroupNormalized:
    """GRPO: ``(r - mean_g) / (std_g + eps)`` (population std of the group)."""

    def __init__(self, eps: float = 1e-6):
        self.eps = eps

    def __call__(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        inv, counts, _, means, sq = _group_stats(rewards, group_ids)
        std = (sq / counts).sqrt()
        return (rewards - means[inv]) / (std[inv] + self.eps)


class GroupCentered:
    """Dr. GRPO: ``r - mean_g`` (no division by the std, which biases towards easy prompts)."""

    def __call__(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        inv, _, _, means, _ = _group_stats(rewards, group_ids)
        return rewards - means[inv]


class LeaveOneOut:
    """RLOO: ``r_i - mean_{j != i} r_j`` within the group; 0 for a group of one."""

    def __call__(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        inv, counts, sums, _, _ = _group_stats(rewards, group_ids)
        n = counts[inv].to(rewards.dtype)
        others = (sums[inv] - rewards) / (n - 1).clamp(min=1)
        return torch.where(n > 1, rewards - others, torch.zeros_like(rewards))
