"""What the loss used, per token, for the trajectory log: the learner's log-probs, the
advantages and the IS weights, recorded by row while the step runs and handed to the
log in the rank's row order (so a mismatch can be traced to the token).

Also the policy entropy of the trained tokens (``actor/entropy``, veRL's name), from the
same logits the loss saw.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from asyncrl.learner.logprobs import process_logits, to_rows
from asyncrl.learner.shard import Layout
from asyncrl.losses.base import LossBatch, ModelOutputs


def local_rows(layout: Layout, minibatches: int, rank: int) -> list[list[int]]:
    """Per minibatch: each of its ``Minibatch.rows`` rows' index in this rank's local
    batch (the order ``learner.shard.split`` lays them out in)."""
    B = len(layout)
    out = []
    for idx in torch.arange(B).tensor_split(min(minibatches, B)):
        rows = idx.tolist()
        if layout.owner is None:  # every rank holds every row
            out.append(rows)
        else:
            out.append([layout.local[i] for i in rows if layout.owner[i] == rank])
    return out


@torch.no_grad()
def is_weights(loss: Any, batch: LossBatch, outputs: ModelOutputs) -> torch.Tensor:
    """``[B, T]`` the IS weight of each token: the loss's own ``weights()`` (truncated or
    masked IS) where it has one, else the plain ratio exp(learner - behaviour) that a
    clipped loss clips (and decoupled PPO's proximal / behaviour weight where it has a
    proximal policy)."""
    out = ModelOutputs(logprobs=outputs.logprobs.detach(), values=outputs.values)
    weights = getattr(loss, "weights", None)
    if callable(weights):
        return weights(batch, out)[0]
    ref = batch.proximal_logprobs if batch.proximal_logprobs is not None else out.logprobs
    return (ref - batch.behaviour_logprobs).clamp(max=20.0).exp()


@torch.no_grad()
def entropy_metric(
    logits: torch.Tensor, pk: Any, mask: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> dict[str, float]:
    """``actor/entropy``: the mean entropy of the sampling distribution over the trained
    tokens of one micro-batch (``pk``: its PackedRows; ``mask`` ``[b, T]``)."""
    if not mask.any():
        return {}
    logp = process_logits(logits.detach(), temperature, top_k, top_p)
    p = logp.exp()
    ent = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)
    dev = logits.device
    rows = to_rows(ent, pk.seq.to(dev), pk.tok.to(dev), tuple(mask.shape))
    return {"actor/entropy": float(rows[mask.to(dev)].double().mean())}


class TokenRecorder:
    """Per local row: its tokens' learner log-probs, advantages and IS weights."""

    def __init__(self) -> None:
        self.rows: dict[int, dict[str, np.ndarray]] = {}

    def add(self, local: list[int], batch: LossBatch, logp: torch.Tensor, isw: torch.Tensor):
        """``local[b]``: row ``b``'s index in the rank's batch; tensors ``[b, T]``."""
        cols = {
            "learner_logprobs": logp.detach().float().cpu().numpy(),
            "advantages": batch.advantages.detach().float().cpu().numpy(),
            "is_weights": isw.detach().float().cpu().numpy(),
        }
        for b, row in enumerate(local):
            self.rows[row] = {k: v[b] for k, v in cols.items()}

    def take(self, n: int, resp_lens: list[int]) -> list[dict[str, np.ndarray] | None]:
        """The records of local rows ``0..n-1`` cut to their response lengths, then
        forgotten (None for a row never recorded)."""
        out: list[dict[str, np.ndarray] | None] = []
        for i in range(n):
            rec = self.rows.get(i)
            out.append(None if rec is None else {k: v[: resp_lens[i]] for k, v in rec.items()})
        self.rows = {}
        return out
