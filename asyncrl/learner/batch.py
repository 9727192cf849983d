"""From trajectories to learner tensors.

A :class:`TrainBatch` holds one row per trajectory. Token tensors are
``[B, L]`` over prompt+response (right-padded, ``L`` = longest row); the
response-aligned tensors the loss sees are ``[B, T]`` (``T`` = longest response).
``resp_start[b]`` is where row ``b``'s response begins inside its ``L`` row.
``images[b]``: the images row ``b`` shows, its prompt's and its observations', in
placeholder order (None when no row shows one).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncrl.learner.config import Normalisation
from asyncrl.trajectory import Image, Trajectory


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, L] int64
    attention_mask: torch.Tensor  # [B, L] int64
    resp_start: torch.Tensor  # [B] int64
    resp_len: torch.Tensor  # [B] int64
    response_ids: torch.Tensor  # [B, T] int64
    behaviour_logprobs: torch.Tensor  # [B, T] float32
    versions: torch.Tensor  # [B, T] int64
    mask: torch.Tensor  # [B, T] bool
    rewards: torch.Tensor  # [B] float32
    group_ids: torch.Tensor  # [B] int64 (dense ids within this batch)
    images: list[list[Image]] | None = None  # per row; None: a text-only batch
    # per row, the experts the engine routed each position to (uint8 [n, layers, top_k],
    # Trajectory.routed_experts) or None; None for the whole batch when no row has one
    routed_experts: list[np.ndarray | None] | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, idx: list[int] | torch.Tensor) -> TrainBatch:
        """A sub-batch (micro-batch), trimmed to its own longest row."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        L = int((self.resp_start[idx] + self.resp_len[idx]).max())
        T = int(self.resp_len[idx].max())
        return TrainBatch(
            input_ids=self.input_ids[idx, :L],
            attention_mask=self.attention_mask[idx, :L],
            resp_start=self.resp_start[idx],
            resp_len=self.resp_len[idx],
            response_ids=self.response_ids[idx, :T],
            behaviour_logprobs=self.behaviour_logprobs[idx, :T],
            versions=self.versions[idx, :T],
            mask=self.mask[idx, :T],
            rewards=self.rewards[idx],
            group_ids=self.group_ids[idx],
            images=None if self.images is None else [self.images[i] for i in idx.tolist()],
            routed_experts=None
            if self.routed_experts is None
            else [self.routed_experts[i] for i in idx.tolist()],
        )


def collate(trajs: list[Trajectory], pad_id: int = 0) -> TrainBatch:
    if not trajs:
        raise ValueError("collate needs at least one trajectory")
    B = len(trajs)
    L = max(t.num_tokens for t in trajs)
    T = max(max(len(t.response_ids) for t in trajs), 1)
    ids = np.full((B, L), pad_id, dtype=np.int64)
    attn = np.zeros((B, L), dtype=np.int64)
    resp = np.full((B, T), pad_id, dtype=np.int64)
    blp = np.zeros((B, T), dtype=np.float32)
    ver = np.zeros((B, T), dtype=np.int64)
    mask = np.zeros((B, T), dtype=bool)
    start = np.zeros(B, dtype=np.int64)
    rlen = np.zeros(B, dtype=np.int64)
    gmap: dict[str, int] = {}
    gids = np.zeros(B, dtype=np.int64)
    for b, t in enumerate(trajs):
        p, r = len(t.prompt_ids), len(t.response_ids)
        ids[b, :p] = t.prompt_ids
        ids[b, p : p + r] = t.response_ids
        attn[b, : p + r] = 1
        resp[b, :r] = t.response_ids
        blp[b, :r] = t.behaviour_logprobs
        ver[b, :r] = t.versions
        mask[b, :r] = t.loss_mask
        start[b], rlen[b] = p, r
        gids[b] = gmap.setdefault(t.group_id, len(gmap))
    return TrainBatch(
        input_ids=torch.from_numpy(ids),
        attention_mask=torch.from_numpy(attn),
        resp_start=torch.from_numpy(start),
        resp_len=torch.from_numpy(rlen),
        response_ids=torch.from_numpy(resp),
        behaviour_logprobs=torch.from_numpy(blp),
        versions=torch.from_numpy(ver),
        mask=torch.from_numpy(mask),
        rewards=torch.tensor([t.reward for t in trajs], dtype=torch.float32),
        group_ids=torch.from_numpy(gids),
        images=[t.images for t in trajs] if any(t.images for t in trajs) else None,
        routed_experts=[t.routed_experts for t in trajs]
        if any(t.routed_experts is not None for t in trajs)
        else None,
    )


def token_budget_chunks(lengths: list[int], budget: int) -> list[list[int]]:
    """Split row indices into micro-batches whose padded size ``rows * max_len`` stays
    within ``budget`` tokens (a row longer than the budget gets a micro-batch alone)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    chunks: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * max(lengths[j] for j in cur + [i]) > budget:
            chunks.append(cur)
            cur = []
        cur.append(i)
    if cur:
        chunks.append(cur)
    return chunks


def _token_weights(m: torch.Tensor, total_tokens: int, total_seqs: int) -> torch.Tensor:
    return m / max(total_tokens, 1)


def _sequence_weights(m: torch.Tensor, total_tokens: int, total_seqs: int) -> torch.Tensor:
    return m / m.sum(1, keepdim=True).clamp(min=1) / max(total_seqs, 1)


_WEIGHTS = {Normalisation.TOKEN: _token_weights, Normalisation.SEQUENCE: _sequence_weights}


def loss_weights(
    mask: torch.Tensor, norm: Normalisation, total_tokens: int, total_seqs: int
) -> torch.Tensor:
    """``[B, T]`` per-token weights under the global normalisation (0 off the mask)."""
    return _WEIGHTS[Normalisation(norm)](mask.float(), total_tokens, total_seqs)
