"""Routing replay (``learner.moe.routing_replay``) and the expert-disagreement metric.

    trajectory.routed_experts  uint8 [n, layers, top_k]: the experts the engine's router
        chose for the token at each of the sequence's first n positions (as input)
      ─▶ collate (TrainBatch.routed_experts) ─▶ per packed micro-batch: [R*S, layers, top_k]
         int64, -1 where nothing was recorded (padding, positions past n)
      ─▶ every MoE layer's router, in its forward:
           own top-k of softmax(logits)         ─▶ counted against the record (metric)
           replay on: the recorded experts where there is a record, its own elsewhere
           weights: softmax(logits) at the chosen experts (renormalised as the model does)

The weights stay the router's own probabilities of the experts used, so the router's
gradient flows with replay as without (R3 as slime, verl and SkyRL ship it). Records
index the model's MoE layers in module order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from asyncrl.learner.batch import TrainBatch
from asyncrl.learner.packing import PackedRows

NO_RECORD = -1  # a position the engine recorded nothing for: the router's own choice


def routers(lm: nn.Module) -> list[nn.Module]:
    """Every MoE layer's top-k router (a ``[num_experts, hidden]`` weight beside ``top_k``
    and ``num_experts``: transformers' Qwen-MoE and Mixtral routers), in module order."""
    return [
        m
        for m in lm.modules()
        if hasattr(m, "top_k") and hasattr(m, "num_experts")
        and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2
    ]  # fmt: skip


class RouterForward:
    """A router's forward: HF's outputs ``(logits [T, E], weights [T, K], experts [T, K])``,
    with ``recorded`` ``[T, K]`` (or None) replayed when ``replay``. Keeps the last call's
    record and chosen experts (``last``) and counts the tokens whose own top-k differs
    from the record."""

    def __init__(self, router: nn.Module, replay: bool):
        self.router, self.replay = router, replay
        self.recorded: torch.Tensor | None = None
        self.last: tuple[torch.Tensor | None, torch.Tensor] | None = None
        self.differ, self.counted = 0, 0

    def __call__(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        r = self.router
        logits = F.linear(hidden.reshape(-1, r.weight.shape[1]), r.weight)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        chosen = torch.topk(probs, r.top_k, dim=-1).indices
        rec = self.recorded
        if rec is not None and rec.shape[0] == chosen.shape[0]:
            rec = rec.to(chosen.device)
            have = (rec >= 0).all(-1)
            if torch.is_grad_enabled():  # a training forward (not log-probs, proximal)
                differ = (chosen.sort(-1).values != rec.sort(-1).values).any(-1) & have
                self.differ += int(differ.sum())
                self.counted += int(have.sum())
            if self.replay:
                chosen = torch.where(have[:, None], rec, chosen)
        weights = probs.gather(-1, chosen)
        if getattr(r, "norm_topk_prob", True):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        self.last = (rec, chosen)
        return logits, weights.to(logits.dtype), chosen


class Routing:
    """The learner's routers (none for a dense model): what each micro-batch's forward
    replays, and the disagreement counts for the metrics."""

    def __init__(self, lm: nn.Module, replay: bool):
        self.forwards = [RouterForward(m, replay) for m in routers(lm)]
        for f in self.forwards:
            f.router.forward = f

    @contextlib.contextmanager
    def records(self, batch: TrainBatch | None, pk: PackedRows) -> Iterator[None]:
        """The routers see ``batch``'s recorded experts laid out as ``pk`` packs them."""
        routes = packed_routes(batch, pk, len(self.forwards)) if self.forwards else None
        for i, f in enumerate(self.forwards):
            f.recorded = None if routes is None else routes[:, i]
        try:
            yield
        finally:
            for f in self.forwards:
                f.recorded = None

    def take(self) -> tuple[dict[str, float], float]:
        """``({"moe/expert_disagreement": fraction}, pairs)`` since the last take: the
        fraction of (recorded position, MoE layer) pairs whose own top-k set differs from
        the record, and how many pairs were counted (its weight in a mean over
        micro-batches and ranks); ``({}, 0)`` when none were."""
        differ = sum(f.differ for f in self.forwards)
        counted = sum(f.counted for f in self.forwards)
        for f in self.forwards:
            f.differ, f.counted = 0, 0
        return ({"moe/expert_disagreement": differ / counted} if counted else {}), float(counted)


def packed_routes(batch: TrainBatch | None, pk: PackedRows, layers: int) -> torch.Tensor | None:
    """``[R * S, layers, top_k]`` int64: each packed position's recorded experts,
    ``NO_RECORD`` where there are none; None when no sequence of ``pk`` has a record."""
    recs = batch.routed_experts if batch is not None else None
    if not recs or not pk.seqs or all(recs[i] is None for i in pk.seqs):
        return None
    k = next(recs[i] for i in pk.seqs if recs[i] is not None).shape[2]
    out = np.full((pk.input_ids.numel(), layers, k), NO_RECORD, dtype=np.int64)
    seq, tok, flat = pk.seq.numpy(), pk.tok.numpy(), pk.flat_pos.numpy()
    first = tok == 0  # each sequence's position predicting its first response token
    starts = batch.resp_start.numpy()
    for b, f in zip(seq[first], flat[first], strict=True):
        rec = recs[pk.seqs[b]]
        if rec is None:
            continue
        begin = int(f) - int(starts[pk.seqs[b]]) + 1  # the sequence's first position
        n = min(len(rec), int(starts[pk.seqs[b]] + batch.resp_len[pk.seqs[b]]))
        out[begin : begin + n] = rec[:n, :layers]
    return torch.from_numpy(out)
