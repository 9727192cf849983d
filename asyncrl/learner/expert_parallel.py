"""Expert parallelism inside each MoE layer (``learner.ep``), by all-to-all over the ranks.

    rank r holds experts [r * E/ep, (r+1) * E/ep) of every MoE layer (a DTensor, Shard(0))
    per MoE layer, on every rank, its own tokens:
      router (local, as HF's)  ─▶ top-k experts per token ─▶ sort the (token, k) pairs by expert
      ─▶ all_to_all_single: each pair's hidden state to the rank holding its expert
      ─▶ that rank runs its experts on what it received (SwiGLU, grouped by expert)
      ─▶ all_to_all_single back (the reverse splits) ─▶ x router weight ─▶ summed per token

The shape follows torchtitan's ``ExpertParallel`` (experts' weights distributed
``Shard(0)`` over the EP mesh, tokens dispatched and combined by ``all_to_all_single``)
and Megatron's all-to-all token dispatcher (counts exchanged first, then the rows,
sorted by expert). The router weights multiply on the token's own rank, so the router's
gradient never crosses ranks; the all-to-all's backward is the all-to-all with the splits
swapped. gloo runs ``all_to_all_single`` with uneven splits on a CPU (NCCL the same call).

The ranks form the mesh ``("dp", "ep")`` (learner/dist.py ``shard``): ``ep`` consecutive
ranks share one copy of the experts, each holding its ``1/ep`` of them, and tokens go
by all-to-all within those ``ep`` ranks only. With ``ep < world_size`` the ``world_size /
ep`` ranks holding the same share (one per ``ep`` group) FSDP-shard it among themselves
and sum its gradients, as Megatron's expert data parallelism and torchtitan's
``dp_mod_ep`` FSDP mesh do; with ``ep == world_size`` FSDP leaves the experts alone
(each expert's gradient is whole on its one rank). The non-expert weights are FSDP-sharded
over every rank, and rows are shared among all ranks as by plain FSDP.

With ``learner.tp > 1`` as well (``tp`` dividing ``ep``: experts not split by ``tp``,
torchtitan's ETP=1) an ``ep`` group is ``ep / tp`` whole tensor-parallel groups, as
torchtitan borrows EP from the data-parallel and TP dimensions. The ``tp`` ranks of one
group hold the same tokens (the hidden state between layers is whole on each), so each
takes its ``1/tp`` of the layer's (token, k) rows first (``to_tp`` / ``from_tp``):

      x, router weights ─▶ to_tp (identity; backward: the ``tp`` ranks' gradients summed)
      ─▶ this ``tp`` rank's rows [T*t/tp, T*(t+1)/tp) ─▶ the all-to-all path above
      ─▶ zeros elsewhere ─▶ from_tp (all-reduce over ``tp``; backward: identity) ─▶ [T, H]

so every token reaches its experts once per data-parallel group, and the output, the
router's gradient and the input's gradient come out whole and equal on every ``tp``
rank, as tensor parallelism keeps everything outside a split layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.nn import functional as F

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # HF's fused 3-D expert tensors [E, ., .]


def expert_modules(lm: nn.Module) -> list[nn.Module]:
    """Every MoE layer's experts (HF's fused ``gate_up_proj`` [E, 2I, H] and ``down_proj``
    [E, H, I] beside ``num_experts``), in module order."""
    return [
        m
        for m in lm.modules()
        if hasattr(m, "num_experts") and all(getattr(m, w, None) is not None for w in EXPERT_WEIGHTS)
        and getattr(m, EXPERT_WEIGHTS[0]).dim() == 3
    ]  # fmt: skip


def parallelize_experts(lm: nn.Module, mesh: Any, tp_mesh: Any = None) -> set[nn.Parameter]:
    """Keep this rank's ``num_experts / ep`` experts of every MoE layer (``Shard(0)`` over
    the 1-D ``mesh``, this rank's ``ep`` group) and route tokens to them by all-to-all
    within that group; with ``tp_mesh`` (this rank's tensor-parallel group, inside its
    ``ep`` group) each ``tp`` rank routes its share of the tokens. Returns the expert
    parameters (the other FSDP units leave them alone). ValueError without experts."""
    mods = expert_modules(lm)
    if not mods:
        raise ValueError(f"{type(lm).__name__} has no fused experts to split (learner.ep)")
    ep, rank = mesh.size(), mesh.get_local_rank()
    params: set[nn.Parameter] = set()
    for m in mods:
        n = m.num_experts // ep
        for name in EXPERT_WEIGHTS:
            full_w = getattr(m, name).detach()
            mine = full_w[rank * n : (rank + 1) * n].clone()
            dt = DTensor.from_local(mine, mesh, [Shard(0)], run_check=False,
                                    shape=full_w.shape, stride=full_w.stride())  # fmt: skip
            p = torch.nn.Parameter(dt)
            setattr(m, name, p)
            params.add(p)
        m.ep_group, m.ep_size, m.local_experts = mesh.get_group(), ep, n
        m.tp_group = tp_mesh.get_group() if tp_mesh is not None else None
        m.tp_size = tp_mesh.size() if tp_mesh is not None else 1
        m.tp_rank = tp_mesh.get_local_rank() if tp_mesh is not None else 0
        m.forward = ExpertsForward(m)
    return params


class ExpertsForward:
    """The forward of one MoE layer's experts under ``learner.ep``: HF's signature
    (``hidden_states`` [T, H], ``top_k_index`` [T, K], ``top_k_weights`` [T, K]) -> [T, H]."""

    def __init__(self, experts: nn.Module):
        self.experts = experts

    def __call__(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        m = self.experts
        if m.tp_size == 1:
            return self.dispatch(x, idx, w)
        x, w = to_tp(x, m.tp_group), to_tp(w, m.tp_group)
        lo, hi = tp_rows(x.shape[0], m.tp_size, m.tp_rank)
        out = self.dispatch(x[lo:hi], idx[lo:hi], w[lo:hi])
        return from_tp(F.pad(out, (0, 0, lo, x.shape[0] - hi)), m.tp_group)

    def dispatch(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The layer's output for this rank's tokens ``x`` [T, H] (each rank of the ``ep``
        group its own), by all-to-all to the experts and back."""
        m = self.experts
        K = idx.shape[1]
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, k) pairs grouped by expert, so by rank
        token = order // K
        sizes = torch.bincount(flat[order] // m.local_experts, minlength=m.ep_size).tolist()
        recv = exchange_counts(sizes, m.ep_group, x.device)
        ids = all_to_all(flat[order] % m.local_experts, recv, sizes, m.ep_group)
        rows = all_to_all(x.index_select(0, token), recv, sizes, m.ep_group)
        out = run_experts(m, rows, ids)
        back = all_to_all(out, sizes, recv, m.ep_group).to(x.dtype)
        back = back * w.reshape(-1)[order].unsqueeze(-1).to(x.dtype)
        return x.new_zeros(x.shape).index_add(0, token, back)


def exchange_counts(sizes: list[int], group: Any, device: torch.device) -> list[int]:
    """How many rows each rank sends this one, given what this one sends each rank
    (on ``device``: NCCL exchanges GPU tensors only)."""
    send = torch.tensor(sizes, dtype=torch.int64, device=device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.tolist()


def all_to_all(x: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group: Any):
    """``x``'s rows, ``in_sizes[j]`` of them to rank j, and back the rows every rank sent
    this one (``out_sizes[j]`` from rank j); differentiable in ``x`` (floating)."""
    if x.is_floating_point():
        return AllToAll.apply(x, out_sizes, in_sizes, group)
    return send_rows(x, out_sizes, in_sizes, group)


def send_rows(x: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group: Any):
    out = x.new_empty((sum(out_sizes), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_sizes, in_sizes, group=group)
    return out


def run_experts(m: nn.Module, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """SwiGLU of this rank's experts on the rows sent to them (``ids``: local expert of
    each row) -> [R, H]. With no rows the weights still join the graph (a zero term), so
    every rank's expert weights get a gradient, as on one rank."""
    gu, dn = m.gate_up_proj.to_local(), m.down_proj.to_local()  # DTensors: this rank's experts
    rows = rows.to(gu.dtype)
    out = rows.new_zeros((rows.shape[0], dn.shape[1]))
    if rows.shape[0] == 0:
        return out + 0.0 * (gu.sum() + dn.sum())
    for e in range(m.local_experts):
        sel = (ids == e).nonzero().squeeze(1)
        if sel.numel() == 0:
            continue
        gate, up = F.linear(rows.index_select(0, sel), gu[e]).chunk(2, dim=-1)
        out = out.index_add(0, sel, F.linear(m.act_fn(gate) * up, dn[e]))
    return out


class AllToAll(torch.autograd.Function):
    """all_to_all_single forward; the reverse exchange of the gradient backward."""

    @staticmethod
    def forward(ctx, x, out_sizes, in_sizes, group):
        ctx.sizes, ctx.group = (out_sizes, in_sizes), group
        return send_rows(x, out_sizes, in_sizes, group)

    @staticmethod
    def backward(ctx, g):
        out_sizes, in_sizes = ctx.sizes
        return send_rows(g, in_sizes, out_sizes, ctx.group), None, None, None


def tp_rows(n: int, tp: int, rank: int) -> tuple[int, int]:
    """``[lo, hi)``: the rows of ``n`` that ``tp`` rank ``rank`` routes (sizes differ by at
    most one; none when ``n < tp``)."""
    return n * rank // tp, n * (rank + 1) // tp


def to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` (equal on every rank of the ``tp`` group) for a part of it to be used on each
    rank: the gradient coming back is each rank's part, summed over the group."""
    return ToTP.apply(x, group)


def from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum over the ``tp`` group of each rank's part (zeros elsewhere); the gradient,
    equal on every rank, goes back to each unchanged."""
    return FromTP.apply(x, group)


class ToTP(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient over the group backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class FromTP(torch.autograd.Function):
    """All-reduce (sum) over the group forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None
