"""Where a trust-region loss gets its proximal policy ``pi_prox`` (``loss.proximal``).

* ``recompute``: ``batch.proximal_logprobs``, the learner's weights at the start of the
  batch, from an extra forward pass without gradient (the loss sets ``needs_proximal``).
* ``loglinear``: no forward pass. AReaL's log-linear approximation
  (docs/en/algorithms/prox_approx.md in inclusionAI/AReaL) interpolates each token's
  log-prob between the behaviour policy that sampled it and the current policy, by how
  far the proximal policy's version lies between theirs::

      log pi_prox ~= log mu + alpha * (log pi - log mu),
      alpha = (v_prox - v_mu) / (v_pi - v_mu) = k / (k + 1)

  with ``v_mu`` the token's version, ``v_prox = learner_version`` (the weights at the
  batch's start), ``v_pi = learner_version + 1`` (where this step moves them) and
  ``k = learner_version - v_mu`` the token's staleness. A fresh token (``k = 0``) gets
  ``pi_prox = mu``; a very stale one gets nearly ``pi``. ``alpha`` is clamped to
  ``[0, 1]`` (a token newer than the learner, which cannot happen, counts as fresh). The
  result carries no gradient.
"""

from __future__ import annotations

import torch

from asyncrl.losses.base import LossBatch, ModelOutputs, masked_mean
from asyncrl.losses.ratios import compute_dtype

PROXIMAL_MODES = ("recompute", "loglinear")


def check_proximal(proximal: str) -> str:
    """``loss.proximal`` as given, or a ValueError naming the key."""
    if proximal not in PROXIMAL_MODES:
        raise ValueError(f"loss.proximal must be one of {PROXIMAL_MODES}, got {proximal!r}")
    return proximal


@torch.no_grad()
def loglinear_alpha(batch: LossBatch) -> torch.Tensor:
    """``[B, T]`` interpolation weight ``k / (k + 1)`` per token, in ``[0, 1)``; 0 on padding."""
    k = (batch.learner_version - batch.versions).clamp(min=0).to(torch.float64)
    return torch.where(batch.mask, k / (k + 1), torch.zeros_like(k))


@torch.no_grad()
def loglinear_proximal(batch: LossBatch, outputs: ModelOutputs) -> torch.Tensor:
    """``[B, T]`` approximate proximal log-probs ``mu + alpha (pi - mu)``, no gradient."""
    dtype = compute_dtype(outputs.logprobs, batch.behaviour_logprobs)
    mu = batch.behaviour_logprobs.to(dtype)
    alpha = loglinear_alpha(batch).to(dtype)
    return mu + alpha * (outputs.logprobs.detach().to(dtype) - mu)


def proximal_logprobs(
    batch: LossBatch, outputs: ModelOutputs, proximal: str, loss_name: str
) -> tuple[torch.Tensor, dict[str, float]]:
    """``[B, T]`` proximal log-probs (no gradient) for ``proximal`` and its metrics
    (``is/proximal_alpha_mean`` for ``loglinear``)."""
    if proximal == "loglinear":
        alpha = loglinear_alpha(batch)
        metrics = {"is/proximal_alpha_mean": float(masked_mean(alpha, batch.mask))}
        return loglinear_proximal(batch, outputs), metrics
    if batch.proximal_logprobs is None:
        raise ValueError(f"{loss_name} needs batch.proximal_logprobs (needs_proximal=True)")
    return batch.proximal_logprobs, {}
