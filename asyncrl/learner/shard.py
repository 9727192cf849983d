"""Which rows of a global batch each learner rank holds and trains on, and what it knows
of the rows it does not hold.

    train_step(items), N ranks:
      share_items: the queue's items (whole groups) onto ranks, fewest trajectories first
      ─▶ each rank fetches and decodes only its items' groups ─▶ collates only its rows
      ─▶ all_gather of one small RowSummary per row (no tokens) ─▶ Layout, the same on
         every rank
    train_step(items), 1 rank, and step_on_batch(batch): the rank holds every row;
      Layout.of_batch reads the same facts from the batch

From the layout alone every rank computes the same advantages (whole groups, whole
batch), minibatch split, loss normalisation (trained tokens and sequences per minibatch)
and micro-batch count, so no tokens travel between ranks. Rows a rank holds stay on it:
with a layout of owners, each minibatch's plan packs each rank's own rows (balanced by
trajectories, not tokens); without, the rows are split by tokens (packing.plan).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from asyncrl.learner.batch import TrainBatch
from asyncrl.learner.packing import PackedRows, PackPlan, build_packed, plan


@dataclass
class RowSummary:
    """One trajectory as the ranks that do not hold it see it (and the step's metrics)."""

    num_tokens: int  # prompt + response
    mask_tokens: int  # trained tokens
    response_len: int
    reward: float
    group_id: str
    min_version: int
    error: str = ""
    reward_breakdown: dict[str, float] = field(default_factory=dict)
    episode: dict[str, float] = field(default_factory=dict)  # Trajectory.episode (multi-turn)
    finish_reason: str = ""  # "length": cut by the token limit

    @classmethod
    def of(cls, t: Any) -> RowSummary:
        return cls(
            num_tokens=t.num_tokens, mask_tokens=int(t.loss_mask.sum()),
            response_len=len(t.response_ids), reward=t.reward, group_id=t.group_id,
            min_version=t.min_version, error=t.error or "", reward_breakdown=t.reward_breakdown,
            episode=t.episode, finish_reason=t.finish_reason,
        )  # fmt: skip


@dataclass
class Layout:
    """The global batch without its tokens: ``B`` rows in queue order."""

    lengths: list[int]  # prompt + response per row (what packing plans by)
    mask_tokens: list[int]  # trained tokens per row
    rewards: torch.Tensor  # [B] float32
    group_ids: torch.Tensor  # [B] int64, dense in order of first appearance
    owner: list[int] | None = None  # rank holding each row; None: every rank holds all
    local: list[int] | None = None  # row -> its index in its holder's local batch

    def __len__(self) -> int:
        return len(self.lengths)

    @classmethod
    def of_batch(cls, batch: TrainBatch) -> Layout:
        """Every rank holds ``batch`` whole."""
        return cls(
            (batch.resp_start + batch.resp_len).tolist(), batch.mask.sum(1).tolist(),
            batch.rewards, batch.group_ids,
        )  # fmt: skip

    @classmethod
    def gathered(cls, per_rank: list[list[tuple[int, list[RowSummary]]]]) -> Layout:
        """From every rank's ``(item index, its rows' summaries)`` (rank order)."""
        rows: list[tuple[int, int, int, RowSummary]] = []  # (item, owner, local, summary)
        for r, mine in enumerate(per_rank):
            n = 0
            for k, summaries in mine:
                for s in summaries:
                    rows.append((k, r, n, s))
                    n += 1
        rows.sort(key=lambda x: (x[0], x[2]))  # queue order; within an item, group order
        gmap: dict[str, int] = {}
        return cls(
            lengths=[s.num_tokens for *_, s in rows],
            mask_tokens=[s.mask_tokens for *_, s in rows],
            rewards=torch.tensor([s.reward for *_, s in rows], dtype=torch.float32),
            group_ids=torch.tensor(
                [gmap.setdefault(s.group_id, len(gmap)) for *_, s in rows], dtype=torch.long
            ),
            owner=[r for _, r, _, _ in rows],
            local=[n for _, _, n, _ in rows],
        )


def share_items(items: list, world_size: int) -> list[int]:
    """The rank that fetches each queue item (a whole group): largest first onto the rank
    with the fewest trajectories so far (ties: the lower rank, the earlier item), so every
    rank computes the same answer from the same items."""
    load = [0] * world_size
    owner = [0] * len(items)
    for k in sorted(range(len(items)), key=lambda k: (-len(items[k].traj_ids), k)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owner[k] = r
        load[r] += len(items[k].traj_ids)
    return owner


def fetch(items: list) -> list[tuple[int, list]]:
    """``(item index, the trajectories to train on)`` for ``items`` (index, BatchItem)
    pairs: one ``ray.get`` for their bundles, only their groups decoded."""
    from asyncrl.replay.queue import resolve_groups

    groups = resolve_groups([it for _, it in items]) if items else []
    return [
        (k, [t for t in g.trajectories if t.traj_id in set(it.traj_ids)])
        for (k, it), g in zip(items, groups, strict=True)
    ]


def in_queue_order(parts: list[list] | None, layout: Layout) -> list:
    """Every rank's rows (``gather_to_rank0`` of each one's trajectories) in queue order;
    ``[]`` where ``parts`` is None (ranks other than 0)."""
    if parts is None:
        return []
    return [parts[r][n] for r, n in zip(layout.owner, layout.local, strict=True)]


@dataclass
class Minibatch:
    """One optimizer step's share of the batch on this rank: its rows (None: it holds
    none), their advantages ``[b]``, the trained tokens and sequences of the whole
    minibatch (every rank's), the plan over every rank and this rank's micro-batches."""

    rows: TrainBatch | None
    adv: torch.Tensor
    tokens: int
    seqs: int
    plan: PackPlan
    packs: list[PackedRows]


def split(
    batch: TrainBatch | None, layout: Layout, adv: torch.Tensor, minibatches: int, rank: int,
    world_size: int, micro_batch_tokens: int, row_tokens: int | None, pad_id: int,
) -> list[Minibatch]:  # fmt: skip
    """One :class:`Minibatch` per optimizer step. A batch smaller than ``minibatches``
    (the queue may hand over part of a group) takes one step per trajectory."""
    B = len(layout)
    out = []
    for idx in torch.arange(B).tensor_split(min(minibatches, B)):
        rows = idx.tolist()
        lengths = [layout.lengths[i] for i in rows]
        if layout.owner is None:  # every rank holds every row: split by tokens
            pl = plan(lengths, world_size, micro_batch_tokens, row_tokens)
            mb = batch.rows(idx) if minibatches > 1 else batch
            at, held = list(range(len(rows))), idx
        else:  # each rank packs the rows it holds
            shares = [[j for j, i in enumerate(rows) if layout.owner[i] == r]
                      for r in range(world_size)]  # fmt: skip
            pl = plan(lengths, world_size, micro_batch_tokens, row_tokens, split=shares)
            mine = shares[rank]
            at = {j: n for n, j in enumerate(mine)}  # minibatch row -> row of ``mb``
            held = torch.tensor([rows[j] for j in mine], dtype=torch.long)
            mb = batch.rows([layout.local[rows[j]] for j in mine]) if mine else None
        own = pl.ranks[rank]
        packs = [
            build_packed(mb, [[at[j] for j in row] for row in own[m]] if m < len(own) else [],
                         pad_id)
            for m in range(pl.num_micro)
        ]  # fmt: skip
        tokens = sum(layout.mask_tokens[i] for i in rows)
        out.append(Minibatch(mb, adv[held], tokens, len(rows), pl, packs))
    return out
