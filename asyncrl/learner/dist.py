"""The learner ranks' process group and FSDP2 sharding.

One torch.distributed group over all learner ranks: NCCL on CUDA, gloo on CPU. The
ranks form a ``(world_size / tp) x tp`` mesh, ``("dp", "tp")``, rank ``dp_rank * tp +
tp_rank``; with ``tp > 1`` each decoder layer is first split over ``tp``
(learner/tensor_parallel.py). With ``ep > 1`` they form ``(world_size / ep) x ep``,
``("dp", "ep")``: each MoE layer's experts are split over ``ep`` and FSDP-sharded over
``dp`` (learner/expert_parallel.py). With both, ``tp`` divides ``ep``: an ``ep`` group is
``ep / tp`` consecutive ``tp`` groups, the experts are not split by ``tp``, and the rest is
as with ``tp`` alone. FSDP2 ``fully_shard`` then wraps every decoder
layer and the root :class:`PolicyModel` (embeddings, final norm, LM head, value head),
over ``dp`` with ``tp``, over every rank without.
bf16 compute with fp32 reduction on CUDA; plain fp32 on CPU. Gradients are *summed*
across ``dp`` (not averaged): each data-parallel group's loss already carries its share
of the global normalisation.
"""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from asyncrl.learner.model import LM_PREFIX, VALUE_PREFIX, PolicyModel
from asyncrl.models.arch import decoder_layers, tower_layers
from asyncrl.transport.reshard import EXPERTS_EP, OTHER, Piece

LOOPBACK = "127.0.0.1"


def pick_device() -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(0)  # Ray gives each rank its own GPU as cuda:0
        return torch.device("cuda", 0)
    return torch.device("cpu")


def init_group(rank: int, world_size: int, rendezvous: str, timeout_s: float, device) -> None:
    """Join the learners' default process group at ``host:port`` (rank 0 hosts the store).
    The store listens on ``host`` only (torch's ``tcp://`` init would listen on every
    interface, unauthenticated): loopback when rank 0 shares the driver's node."""
    from asyncrl.transport.group import bound_store

    host, _, port = rendezvous.rpartition(":")
    if host == LOOPBACK and device.type == "cpu":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # stay on loopback
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend,
        store=bound_store(host, int(port), world_size, rank == 0, timeout),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def shard(
    policy: PolicyModel, world_size: int, device: torch.device, tp: int = 1, ep: int = 1
) -> None:
    """With ``tp > 1`` split each decoder layer over the mesh's ``tp`` dimension; with
    ``ep > 1`` each rank keeps its ``ep`` rank's share of every MoE layer's experts
    (learner/expert_parallel.py), FSDP-sharded over the ``dp`` ranks that hold the same
    share (their own FSDP units, as torchtitan shards experts over its ``dp_mod_ep``
    mesh; with ``ep == world_size`` FSDP leaves them alone; with ``tp > 1`` too, each
    ``tp`` rank routes its share of the tokens); then ``fully_shard`` each block of a
    vision tower (whole on every ``tp`` rank), each decoder layer and the root over
    ``dp`` (``tp``) or every rank; sum-reduce gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from asyncrl.learner.expert_parallel import expert_modules, parallelize_experts
    from asyncrl.learner.tensor_parallel import parallelize_layers

    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if device.type == "cuda"
        else MixedPrecisionPolicy()
    )
    tp_mesh = None
    if tp > 1:
        mesh = init_device_mesh(device.type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
        tp_mesh = mesh["tp"]
        parallelize_layers(decoder_layers(policy.lm), policy.lm.config, tp_mesh, ep)
        mesh = mesh["dp"]
    else:
        mesh = init_device_mesh(device.type, (world_size,))
    experts: set[nn.Parameter] = set()
    if ep > 1:
        dp_ep = init_device_mesh(device.type, (world_size // ep, ep), mesh_dim_names=("dp", "ep"))
        experts = parallelize_experts(policy.lm, dp_ep["ep"], tp_mesh)
        if world_size > ep:  # replicated over dp: shard them there, gradients summed
            for m in expert_modules(policy.lm):
                fully_shard(m, mesh=dp_ep["dp"], mp_policy=mp)
    for block in tower_layers(policy.lm) or ():
        fully_shard(block, mesh=mesh, mp_policy=mp)
    for layer in decoder_layers(policy.lm):
        fully_shard(layer, mesh=mesh, mp_policy=mp, ignored_params=experts)
    fully_shard(policy, mesh=mesh, mp_policy=mp, ignored_params=experts)
    for m in policy.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)
            # a plain SUM (gloo has no PREMUL_SUM); with factor 1 nothing is rescaled
            m.set_force_sum_reduction_for_comms(True)


def fsdp_units(policy: PolicyModel) -> list[tuple[nn.Module, list[str]]]:
    """``(module, names of the parameters it owns)`` per FSDP unit: the root first, then
    each block of a vision tower, then each decoder layer followed by the units inside
    it (a MoE layer's experts with ``ep < world_size``); a parameter belongs to the
    innermost unit holding it. Names are :class:`PolicyModel` FQNs (``named_parameters``
    drops the tied LM head)."""
    from torch.distributed.fsdp import FSDPModule

    module_names = {id(m): n for n, m in policy.named_modules()}
    blocks = [*(tower_layers(policy.lm) or ()), *decoder_layers(policy.lm)]
    mods = [policy] + [
        m for layer in blocks for m in layer.modules()
        if m is layer or isinstance(m, FSDPModule)
    ]  # fmt: skip
    prefix = [module_names[id(m)] + "." if m is not policy else "" for m in mods]
    owned: list[list[str]] = [[] for _ in mods]
    for n, _ in policy.named_parameters():
        owner = max((k for k, pre in enumerate(prefix) if n.startswith(pre)),
                    key=lambda k: len(prefix[k]))  # fmt: skip
        owned[owner].append(n)
    return list(zip(mods, owned))


def stream_parameters(policy: PolicyModel, sharded: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, full tensor)``, one FSDP unit unsharded at a time. A yielded tensor is
    only valid until the next item is requested (the unit is resharded): copy to keep.
    Every rank must iterate in step (unsharding is a collective). Skips the value head
    and, when embeddings are tied, ``lm_head.weight`` (the receiver ties it itself)."""
    if not sharded:
        for n, p in policy.named_parameters():
            if n.startswith(LM_PREFIX):
                yield n[len(LM_PREFIX) :], p.detach()
        return
    for module, names in fsdp_units(policy):
        module.unshard()
        try:
            for n in names:
                if n.startswith(LM_PREFIX):
                    yield n[len(LM_PREFIX) :], full(policy.get_parameter(n).detach())
        finally:
            module.reshard()


def tp_layout(policy: PolicyModel) -> list[tuple[str, tuple[int, ...], int | None]]:
    """``(HF name, full shape, split)`` per tensor of the sharded stream, in its order:
    ``split`` the dimension whose ``1/tp`` part each ``tp`` rank holds (rank ``r`` the
    ``r``-th), None where every ``tp`` rank holds the tensor whole, ``EXPERTS_EP`` for
    fused experts split by expert (``Shard(0)``) over ``ep`` (whose groups are whole
    ``tp`` groups: ``tp`` divides ``ep``), ``OTHER`` for one split some other way (an
    uneven split). From the placements alone: no collective."""
    out = []
    for _, names in fsdp_units(policy):
        for n in names:
            if n.startswith(LM_PREFIX):
                p = policy.get_parameter(n)
                out.append((n[len(LM_PREFIX) :], tuple(p.shape), tp_split(p)))
    return out


def tp_split(t: torch.Tensor) -> int | None:
    """See :func:`tp_layout`: how the ``tp`` ranks hold ``t`` (a DTensor or not)."""
    mesh = getattr(t, "device_mesh", None)
    if mesh is None:
        return None
    names = mesh.mesh_dim_names or ("dp",) * mesh.ndim  # unnamed: plain FSDP's mesh
    for i, (name, p) in enumerate(zip(names, t.placements, strict=True)):
        if name == "tp" and p.is_shard():
            return p.dim if t.shape[p.dim] % mesh.size(i) == 0 else OTHER
        if name == "ep" and p.is_shard(0) and t.shape[0] % mesh.size(i) == 0:
            return EXPERTS_EP
        if name not in ("dp", "tp") and not p.is_replicate():
            return OTHER
    return None


def stream_local(
    policy: PolicyModel,
    gather: Collection[str],
    exchange: Mapping[str, tuple[tuple[Piece, ...], ...]] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, what this rank holds of it)`` in :func:`stream_parameters`' order:
    its own ``tp`` shard of a split tensor (no ``tp`` collective), the whole tensor of
    one every ``tp`` rank holds, the whole tensor (:func:`full`, a collective) of each
    name in ``gather``, and this ``tp`` rank's pieces of every expert of each name in
    ``exchange`` (:func:`swap_experts`, a collective over ``ep``). One FSDP unit
    unsharded at a time, valid until the next item; every rank iterates in step."""
    exchange = exchange or {}
    for module, names in fsdp_units(policy):
        module.unshard()
        try:
            for n in names:
                if n.startswith(LM_PREFIX):
                    hf, p = n[len(LM_PREFIX) :], policy.get_parameter(n).detach()
                    if hf in exchange:
                        yield hf, swap_experts(p, exchange[hf])
                    else:
                        yield hf, full(p) if hf in gather else local(p)
        finally:
            module.reshard()


def swap_experts(t: torch.Tensor, pieces: tuple[tuple[Piece, ...], ...]) -> torch.Tensor:
    """This rank's engine pieces of every expert of ``t``, fused experts held
    ``Shard(0)`` over the mesh's ``ep`` dimension (asyncrl/transport/reshard.py
    ``DirectPlan.exchange``; ``pieces[k]``: what TP rank ``k`` of ``len(pieces)`` takes,
    along one dimension past the experts'). One even all-to-all over the ``ep`` group:
    peer ``e`` (TP rank ``e % tp``, as the mesh lays ``tp`` groups inside ``ep``
    groups) gets ``pieces[e % tp]`` of this rank's experts, concatenated along their
    dimension; this rank gets its own TP rank's from every peer, stacked in expert
    order: ``[experts, ...]``. Collective over ``ep``; exact (bytes moved, no
    arithmetic)."""
    mesh = t.device_mesh  # type: ignore[attr-defined]
    i = mesh.mesh_dim_names.index("ep")
    ep, tp = mesh.size(i), len(pieces)
    mine = local(t)

    def cut(ps: tuple[Piece, ...]) -> torch.Tensor:
        return torch.cat([mine.narrow(p.dim, p.start, p.length) for p in ps], dim=ps[0].dim)

    send = torch.stack([cut(pieces[e % tp]) for e in range(ep)])
    got = torch.empty_like(send)
    dist.all_to_all_single(got, send, group=mesh.get_group(i))
    return got.flatten(0, 1)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a tensor-parallel DTensor (FSDP's unsharded parameter of a split
    layer; collective over its ``tp`` group), the tensor itself otherwise."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t


def replicas(t: torch.Tensor) -> int:
    """How many ranks hold each element of ``t``: all of them over the ranks its DTensor
    placements shard it across (a parameter replicated over ``tp`` and sharded over ``dp``
    is held ``tp`` times); 1 without a group."""
    if not is_distributed():
        return 1
    mesh = getattr(t, "device_mesh", None)
    if mesh is None:
        return dist.get_world_size()
    if any(p.is_partial() for p in t.placements):
        raise ValueError("a partial-sum DTensor has no per-element copies; reduce it first")
    # a mesh dimension that does not replicate shards (Shard, and FSDP's _StridedShard
    # over a dimension tensor parallelism already split)
    shards = math.prod(mesh.size(i) for i, p in enumerate(t.placements) if not p.is_replicate())
    return dist.get_world_size() // shards


def global_norm(tensors: list[torch.Tensor], copies: list[int]) -> torch.Tensor:
    """The L2 norm of the global ``tensors`` (DTensors or plain), each held ``copies``
    times across the ranks (:func:`replicas`): every rank's local shards' squared norms,
    divided by their copies, summed over all ranks in float64. The same on every rank;
    collective. Unlike torch's ``get_total_norm`` it takes DTensors on different meshes
    (the ``("dp", "tp")`` mesh of split layers beside the ``dp`` mesh of the rest)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    norms = torch._foreach_norm([local(t).detach() for t in tensors])
    sq = torch.stack([n.double() for n in norms]).pow(2)
    sq = (sq / torch.tensor(copies, dtype=torch.float64, device=sq.device)).sum()
    return all_reduce_sum(sq).sqrt()


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    if is_distributed():
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def gather_to_rank0(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (in rank order); None elsewhere."""
    if not is_distributed():
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` on every rank (in rank order)."""
    if not is_distributed():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_from_rank0(obj: Any) -> Any:
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def value_param(name: str) -> bool:
    return name.startswith(VALUE_PREFIX)
