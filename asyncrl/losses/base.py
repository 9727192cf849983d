"""The loss contract: ``loss(batch, outputs) -> LossOutput(loss, metrics)``.

Every tensor is laid out per sequence over the *response* tokens, right-padded:
shape ``[B, T]`` where ``B`` is the number of trajectories in the (micro-)batch
and ``T`` the longest response in it. Padding positions have ``mask == False``
and carry arbitrary (finite) values.

Normalisation is the learner's business, not the loss's: ``batch.loss_weights``
holds per-token weights that already sum to one over the *global* batch (all
ranks, all micro-batches). A loss reduces its per-token terms with
:func:`weighted_sum`, so summing micro-batch losses gives the same number
whatever the world size or micro-batching.

A loss declares what it needs with class attributes; the learner computes only
that:

* ``needs_proximal``: ``batch.proximal_logprobs`` (the learner's policy at the
  start of the batch, computed once per batch without gradient, before the first
  of its ``learner.minibatches`` optimizer steps);
* ``needs_values``: ``outputs.values`` (the learner's value head).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass
class LossBatch:
    """What the learner knows about the sampled tokens (no gradient anywhere).

    Shapes: ``[B, T]`` unless stated.
    """

    behaviour_logprobs: (
        torch.Tensor
    )  # float; log-prob of each token under the sampling policy (vLLM, processed)
    versions: torch.Tensor  # int64; policy version that generated each token
    mask: torch.Tensor  # bool; tokens that are trained on (response tokens, not env/tool tokens)
    advantages: (
        torch.Tensor
    )  # float; per-token advantages (sequence advantages broadcast over tokens)
    loss_weights: torch.Tensor  # float; sums to 1 over the global batch; 0 where mask is False
    rewards: torch.Tensor  # [B] float; scalar reward of each trajectory
    group_ids: torch.Tensor  # [B] int64; trajectories sampled from one prompt share a group id
    learner_version: int  # version of the weights the learner holds at the start of this step
    proximal_logprobs: torch.Tensor | None = (
        None  # float; learner's policy at the batch's start (if needed)
    )

    @property
    def staleness(self) -> torch.Tensor:
        """[B] int64: ``learner_version - min(token versions)`` over valid tokens."""
        big = torch.iinfo(torch.int64).max
        v = torch.where(self.mask, self.versions, torch.full_like(self.versions, big))
        vmin = v.min(dim=1).values
        vmin = torch.where(vmin == big, torch.full_like(vmin, self.learner_version), vmin)
        return self.learner_version - vmin


@dataclass
class ModelOutputs:
    """What the learner's forward pass produced (with gradient)."""

    logprobs: torch.Tensor  # [B, T] float; current policy log-prob of each sampled token
    values: torch.Tensor | None = (
        None  # [B, T] float; value-head estimate at each response position
    )


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable; already normalised by batch.loss_weights
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Loss(Protocol):
    needs_proximal: bool
    needs_values: bool

    def __call__(self, batch: LossBatch, outputs: ModelOutputs) -> LossOutput: ...


def weighted_sum(per_token: torch.Tensor, batch: LossBatch) -> torch.Tensor:
    """Reduce ``[B, T]`` per-token terms with the learner's global normalisation."""
    w = batch.loss_weights.to(per_token.dtype)
    return torch.where(batch.mask, per_token * w, torch.zeros_like(per_token)).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ``mask`` (0 when the mask is empty)."""
    n = mask.sum()
    return torch.where(mask, x, torch.zeros_like(x)).sum() / n.clamp(min=1)
