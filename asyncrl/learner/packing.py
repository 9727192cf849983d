"""Sequence packing: where every trajectory of a global batch goes.

    lengths ──split_across_ranks (tokens, LPT)──▶ per rank ──pack_rows (even LPT)──▶ rows
            ──group_rows (token budget)──▶ micro-batches: [rank][micro][row] -> sequences

Every rank computes the same :class:`PackPlan` from the same lengths (pure,
deterministic), so no rank has to tell another what it holds. A packed row is ``[seq a | seq b | ... |
pad]`` with position ids restarting at 0 for every sequence; HF models (transformers 5,
``masking_utils.find_packed_sequence_indices``) turn restarting position ids into a
block-diagonal causal mask, so a token attends only within its own sequence. Rows of a
micro-batch are right-padded to the longest row; ``slots = rows * width``.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from asyncrl.learner.batch import TrainBatch
from asyncrl.trajectory import Image

# Auto row width = this many times the longest sequence (capped by the micro-batch
# budget): rows then hold ~8 sequences, so the slack of one row is a small fraction,
# while attention over a row (quadratic, no varlen kernel on CPU) costs at most 8x
# that of a padded single-sequence row.
AUTO_ROW_FACTOR = 8


class SequenceTooLong(ValueError):
    pass


def split_across_ranks(lengths: list[int], world_size: int) -> list[list[int]]:
    """Sequence indices per rank, balanced by token count (longest first onto the least
    loaded rank); ties go to the lower rank, so the split is deterministic."""
    load = [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        out[r].append(i)
        load[r] += lengths[i]
    return out


def pack_rows(idx: list[int], lengths: list[int], capacity: int) -> list[list[int]]:
    """As few rows as fit, filled evenly: start from ``ceil(tokens / capacity)`` rows and
    place sequences longest first onto the emptiest row; add a row and retry when one
    does not fit. Even rows keep the padding to the widest row small."""
    order = sorted(idx, key=lambda i: (-lengths[i], i))
    n = max(1, math.ceil(sum(lengths[i] for i in idx) / capacity))
    while True:
        heap = [(0, r) for r in range(n)]  # (fill, row id)
        rows: list[list[int]] = [[] for _ in range(n)]
        for i in order:
            fill, r = heapq.heappop(heap)
            if fill + lengths[i] > capacity:
                break
            rows[r].append(i)
            heapq.heappush(heap, (fill + lengths[i], r))
        else:
            return [r for r in rows if r]
        n += 1


def group_rows(rows: list[list[int]], lengths: list[int], budget: int) -> list[list[list[int]]]:
    """Micro-batches of rows whose padded size ``rows * widest`` stays within ``budget``."""
    fill = [sum(lengths[i] for i in r) for r in rows]
    out: list[list[list[int]]] = []
    cur: list[int] = []
    for r in sorted(range(len(rows)), key=lambda r: (-fill[r], r)):
        if cur and (len(cur) + 1) * max(fill[j] for j in cur + [r]) > budget:
            out.append([rows[j] for j in cur])
            cur = []
        cur.append(r)
    if cur:
        out.append([rows[j] for j in cur])
    return out


@dataclass
class PackPlan:
    """``ranks[r][m]`` is micro-batch ``m`` of rank ``r``: a list of rows, each a list of
    sequence indices in row order. Ranks with fewer micro-batches than ``num_micro``
    run empty ones so that their collectives line up."""

    ranks: list[list[list[list[int]]]]
    lengths: list[int]
    row_tokens: int

    @property
    def num_micro(self) -> int:
        return max((len(m) for m in self.ranks), default=0)

    def slots(self) -> int:
        return sum(
            len(mb) * max(sum(self.lengths[i] for i in row) for row in mb)
            for micro in self.ranks
            for mb in micro
        )

    def efficiency(self) -> float:
        """Real tokens / slots (1.0 = no padding)."""
        return sum(self.lengths) / max(self.slots(), 1)


def plan(
    lengths: list[int],
    world_size: int,
    micro_batch_tokens: int,
    row_tokens: int | None = None,
    split: list[list[int]] | None = None,
) -> PackPlan:
    """Place every sequence; raises :class:`SequenceTooLong` for one over the budget.
    ``split``: the sequences of each rank, when the ranks hold different rows (default:
    :func:`split_across_ranks`)."""
    longest = max(lengths, default=1)
    if longest > micro_batch_tokens:
        i = lengths.index(longest)
        raise SequenceTooLong(
            f"sequence {i} has {longest} tokens (prompt + response), more than "
            f"learner.micro_batch_tokens={micro_batch_tokens}; raise it or lower "
            f"actor.sampling.max_tokens"
        )
    cap = row_tokens or AUTO_ROW_FACTOR * longest
    cap = max(longest, min(cap, micro_batch_tokens))
    ranks = [
        group_rows(pack_rows(idx, lengths, cap), lengths, micro_batch_tokens)
        for idx in (split if split is not None else split_across_ranks(lengths, world_size))
    ]
    return PackPlan(ranks, list(lengths), cap)


@dataclass
class PackedRows:
    """One micro-batch in packed form. ``N`` = response tokens in it.

    ``flat_pos[n]`` indexes ``input_ids.view(-1)``: the position whose logits predict
    response token ``tok[n]`` of local sequence ``seq[n]`` (``targets[n]`` is that token).
    ``seqs[b]`` is the global batch index of local sequence ``b``. ``images``: the
    sequences' images in the order their placeholder tokens appear in
    ``input_ids.view(-1)`` (row by row, sequence by sequence): the order the model puts
    image features into image tokens.
    """

    input_ids: torch.Tensor  # [R, S] int64
    position_ids: torch.Tensor  # [R, S] int64, restarting at 0 per sequence (and for pad)
    flat_pos: torch.Tensor  # [N] int64
    seq: torch.Tensor  # [N] int64, local sequence index
    tok: torch.Tensor  # [N] int64, index within the response
    targets: torch.Tensor  # [N] int64
    seqs: list[int]
    images: list[Image] = field(default_factory=list)
    # [R, S] bool (images only): the tokens the policy did not generate, the prompts' and
    # the observations' (response tokens outside the loss mask): where image features go
    context_mask: torch.Tensor | None = None


def build_packed(batch: TrainBatch, rows: list[list[int]], pad_id: int = 0) -> PackedRows:
    """Lay the rows' sequences out; an empty ``rows`` gives a one-token dummy (a rank
    with nothing to do still runs the forward/backward its peers' collectives need)."""
    if not rows:
        z = torch.zeros(1, dtype=torch.long)
        return PackedRows(torch.full((1, 1), pad_id), torch.zeros((1, 1), dtype=torch.long),
                          z, z, z, z, [])  # fmt: skip
    # numpy: per-sequence slicing of torch tensors costs ~100x more in op overhead
    src, resp = batch.input_ids.numpy(), batch.response_ids.numpy()
    start, rlen = batch.resp_start.numpy(), batch.resp_len.numpy()
    lens = start + rlen
    seqs = [i for row in rows for i in row]
    if (start[seqs] < 1).any():
        i = seqs[int(np.argmax(start[seqs] < 1))]
        raise ValueError(f"sequence {i} has an empty prompt: nothing predicts its first token")
    width = max(int(lens[row].sum()) for row in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    pos = np.zeros((len(rows), width), dtype=np.int64)
    ramp = np.arange(width)
    first = []  # flat index of each sequence's first response-predicting position
    for r, row in enumerate(rows):
        off = 0
        for i in row:
            n = lens[i]
            ids[r, off : off + n] = src[i, :n]
            pos[r, off : off + n] = ramp[:n]
            first.append(r * width + off + start[i] - 1)
            off += n
        pos[r, off:] = ramp[: width - off]  # padding: a sequence of its own
    k = rlen[seqs]
    seq = np.repeat(np.arange(len(seqs)), k)
    tok = np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)
    flat = np.repeat(np.asarray(first, dtype=np.int64), k) + tok
    tgt = resp[np.asarray(seqs)[seq], tok]
    t = torch.from_numpy
    out = PackedRows(t(ids), t(pos), t(flat), t(seq), t(tok), t(tgt.astype(np.int64)), seqs)
    if batch.images is not None:
        out.images = [im for i in seqs for im in batch.images[i]]
        trained = batch.mask.numpy()
        out.context_mask = t(context_positions(rows, lens, start, trained, width))
    return out


def context_positions(
    rows: list[list[int]], lens: np.ndarray, start: np.ndarray, trained: np.ndarray, width: int
) -> np.ndarray:
    """``[R, width]`` bool: True at the packed rows' prompt tokens and at their response
    tokens outside the loss mask (``trained[i]``: sequence ``i``'s, response-aligned)."""
    mask = np.zeros((len(rows), width), dtype=bool)
    for r, row in enumerate(rows):
        off = 0
        for i in row:
            mask[r, off : off + start[i]] = True
            n = lens[i] - start[i]
            mask[r, off + start[i] : off + lens[i]] = ~trained[i, :n]
            off += lens[i]
    return mask
