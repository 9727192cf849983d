"""A learner rank's weights, out to the brokers: the methods the brokers call on a rank
(a Ray actor), held by :class:`~asyncrl.learner.learner.Learner` as ``weights``.

    process-group broker                   this rank (rank 0 sends; the others only take
                                           part in the collective unshard of a sharded
                                           learner)
    start ── attach_broker ──────────────▶ rank 0's SenderSide (self._sender) ─▶ Attached
                                           (direct: the other senders' too)
    publish(V) ── snapshot_weights ───────▶ pack a copy of the weights as V (every rank);
                                           direct (order.tp > 1): each rank of
                                           order.senders packs its own engine shard
    per sync set ── send_weights(SendOrder) ▶ rank 0 (direct: every sender),
                                           in the ``weights`` concurrency group
                                           (overlaps a train step) ─▶ SendDone
    close ── detach_broker ───────────────▶ the groups close
    checks ── weight_digests ─────────────▶ per-tensor sha256 of the live weights

    object-store broker
    publish(V) ── weights_ref ────▶ one ray.put of the weights (broker/payload.py)

Built with the rank, whether the learner is sharded, and ``stream``, its
``named_parameters_stream()`` (``(HF name, full tensor)``, collective on a sharded
learner: every rank iterates it); a subclass with a plain ``model`` and no stream
streams the model's state dict. The Ray actor class of whoever exposes these methods
(:class:`~asyncrl.learner.rank.LearnerRank` in a run) is made with
``concurrency_groups=CONCURRENCY_GROUPS``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from asyncrl.broker.learner_side import SenderSide
from asyncrl.broker.messages import (
    WEIGHTS_GROUP,
    Attached,
    CloseGroups,
    SendDone,
    SendOrder,
    Snapshot,
    SnapshotOrder,
)
from asyncrl.broker.settings import BrokerSettings

try:
    from ray import method as ray_method
except ImportError:  # a learner used without Ray (benchmarks/gpu_learner_check.py)

    def ray_method(**_options: Any) -> Callable[[Callable], Callable]:
        return lambda f: f


Stream = Callable[[], Iterator[tuple[str, torch.Tensor]]]  # (HF name, full tensor), in order
# (names to gather whole, expert tensors to exchange over ep) -> (HF name, what this rank
# holds: its TP shard, the whole tensor, or its pieces of every expert): dist.stream_local
LocalStream = Callable[[frozenset[str], Mapping[str, Any]], Iterator[tuple[str, torch.Tensor]]]
Layout = list[tuple[str, tuple[int, ...], int | None]]  # dist.tp_layout


def export_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``model.state_dict()``, each tensor once (a tied LM head shares the embedding's
    storage and vLLM ties it itself)."""
    seen: set[tuple] = set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        yield name, t.detach()


class WeightsOut:
    rank: int = 0
    sharded: bool = False  # the stream's tensors are transient (FSDP unshards)
    _sender: SenderSide | None = None  # while a process-group broker is attached
    _stream: Stream | None = None

    model_config: dict[str, Any] | None = None  # the HF config (resharding plans)
    tp_rank: int = 0
    tp: int = 1  # learner.tp
    _layout: Callable[[], Layout] | None = None
    _local: LocalStream | None = None

    def __init__(
        self,
        rank: int = 0,
        sharded: bool = False,
        stream: Stream | None = None,
        model_config: dict[str, Any] | None = None,
        tp: tuple[int, int, Callable[[], Layout], LocalStream] | None = None,
    ):
        """``tp``: a sharded learner's ``(tp_rank, learner.tp, layout, local stream)``
        (asyncrl/learner/dist.py ``tp_layout``, ``stream_local``): its ranks can cut
        engine shards themselves."""
        self.rank, self.sharded, self._stream = rank, sharded, stream
        self.model_config = model_config
        if tp is not None:
            self.tp_rank, self.tp, self._layout, self._local = tp

    def named_parameters_stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._stream is not None:
            return self._stream()  # the Learner's: FSDP units
        return export_state(self.model)  # a plain model

    def stream_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream as CPU copies, for a Ray streaming call (``LearnerGroup``); ranks
        other than 0 take part in the unsharding and yield nothing."""
        for name, t in self.named_parameters_stream():
            if self.rank == 0:
                yield name, t.detach().to("cpu", copy=True)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named full weights on rank 0 (CPU copies), ``{}`` elsewhere."""
        sd = {}
        for name, t in self.named_parameters_stream():
            if self.rank == 0:
                sd[name] = t.detach().to("cpu", copy=True)
        return sd

    def engine_shard(
        self, tp: int, index: int | None
    ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
        """Engine rank ``index``'s shard of ``tp``, cut from what this rank holds:
        ``(engine name, tensor)`` as the full-tensor plan cuts it
        (asyncrl/transport/reshard.py ``direct_plan``), cut as the stream comes (a
        target once its sources are in, each source dropped after its last target), and
        what it took: ``held_bytes`` (the most this rank held at once to cut it: a few
        tensors of one layer), ``gathered`` (the tensors gathered whole),
        ``exchanged`` (the expert tensors swapped within the ``ep`` group). Collective:
        every rank calls it; ``index`` None takes part without cutting (an empty shard).
        ValueError when this rank's TP part does not hold ``index``'s slices (``tp`` not
        a multiple of ``learner.tp``, or another TP rank's engine shard)."""
        from asyncrl.transport.reshard import direct_plan, part_of

        if self._local is None or self._layout is None or tp < 2 or tp % self.tp:
            raise ValueError(
                f"engine TP size {tp}: this learner rank (learner.tp={self.tp}) cannot cut "
                "engine shards"
            )
        if index is not None and part_of(index, tp, self.tp) != self.tp_rank:
            raise ValueError(
                f"engine rank {index} of {tp}: not in learner TP rank {self.tp_rank}'s part"
            )
        if self.model_config is None:
            raise ValueError("resharding needs the model's config")
        direct = direct_plan(self.model_config, self._layout(), tp, self.tp)
        targets = direct.plan.ranks[index] if index is not None else ()
        last = {p.source: i for i, t in enumerate(targets) for p in t.pieces}
        held: dict[str, torch.Tensor] = {}  # sources of the targets not yet cut
        shard: list[tuple[str, torch.Tensor]] = []
        peak = 0
        for name, t in self._local(direct.gather, direct.exchange):  # collective
            if name not in last:
                continue
            held[name] = t.clone()  # the stream's tensor lives until its next item
            peak = max(peak, sum(x.numel() * x.element_size() for x in held.values()))
            while len(shard) < len(targets) and all(
                p.source in held for p in targets[len(shard)].pieces
            ):
                target = targets[len(shard)]
                cut = target.cut(held)  # a view of one source, or a new concatenation
                shard.append((target.name, cut.clone() if len(target.pieces) == 1 else cut))
                for p in target.pieces:
                    if last[p.source] == len(shard) - 1:
                        held.pop(p.source, None)
        if len(shard) < len(targets):
            raise ValueError(
                f"engine rank {index}: {targets[len(shard)].name}'s sources never came"
            )
        took = {"gathered": sorted(direct.gather), "exchanged": sorted(direct.exchange)}
        return shard, {"held_bytes": peak, **took}

    def shard_digests(self, tp: int, index: int | None = None) -> dict[str, Any]:
        """Every rank: the digests of :meth:`engine_shard` of engine rank ``index``
        (default: the first of this rank's TP part) with its bytes (``nbytes``) and what
        it took (bit-exactness checks against the full-tensor plan)."""
        from asyncrl.transport.endpoint import digests

        if index is None:
            index = self.tp_rank * (tp // self.tp)
        shard, took = self.engine_shard(tp, index)
        nbytes = sum(t.numel() * t.element_size() for _, t in shard)
        return {
            "tp_rank": self.tp_rank, "index": index, "digests": digests(shard),
            "nbytes": nbytes, **took,
        }  # fmt: skip

    # ---- the process-group broker -----------------------------------------------------
    def attach_broker(
        self, broker_id: str, broker: Any, settings: BrokerSettings, shard: int = 0
    ) -> Attached:
        """Rank 0, or the rank that sends engine shard ``shard`` itself (direct): the
        sender endpoint for ``broker`` (a Ray handle). Attaching again replaces the
        previous broker's. ``Attached.cuts``: this learner's ranks can cut engine shards
        (sharded, without LoRA); ``Attached.tp``: its ``learner.tp``."""
        self.detach_broker()
        config = self.model_config
        if config is None and hasattr(getattr(self, "model", None), "config"):
            config = self.model.config.to_dict()  # a plain model's
        self._sender = SenderSide.start(broker_id, broker, settings, config, shard)
        cuts = self._local is not None and config is not None
        return self._sender.attached(os.getpid(), self.tp, cuts)

    def snapshot_weights(self, order: SnapshotOrder) -> Snapshot | None:
        """Rank 0: pack the weights as ``order.version`` for the attached broker (a copy:
        the learner may train on once this returns). Other ranks take part in the
        stream and return None. ``order.tp`` > 1: rank ``order.senders[t]`` cuts and packs
        engine shard ``t``; every rank takes part in the collective unshard."""
        if order.tp > 1:
            index = order.senders.index(self.rank) if self.rank in order.senders else None
            shard, _ = self.engine_shard(order.tp, index)
            if index is None:
                return None
            return self._attached(order.broker_id).snapshot(order, shard, transient=False)
        stream = self.named_parameters_stream()
        if self.rank != 0:
            for _ in stream:
                pass
            return None
        return self._attached(order.broker_id).snapshot(order, stream)

    @ray_method(concurrency_group=WEIGHTS_GROUP)
    def send_weights(self, order: SendOrder) -> SendDone:
        """Rank 0 (direct: each sender of an engine shard): one set's transfer (beside a
        train step, in its own thread)."""
        if self._sender is None:
            return SendDone(
                order.key, False, error=f"no broker is attached to learner rank {self.rank}"
            )
        return self._sender.send(order)

    @ray_method(concurrency_group=WEIGHTS_GROUP)
    def close_send_groups(self, order: CloseGroups) -> None:
        if self._sender is not None:
            self._sender.close(order.keys)

    def _attached(self, broker_id: str) -> SenderSide:
        if self._sender is None or self._sender.broker_id != broker_id:
            raise RuntimeError(f"broker {broker_id} is not attached to this learner rank")
        return self._sender

    def detach_broker(self) -> None:
        if self._sender is not None:
            self._sender.stop()
            self._sender = None

    def weight_digests(self) -> dict[str, str]:
        """Per-tensor digests of the live weights (bit-exactness checks); every rank of a
        sharded learner must call it, and only rank 0's answer means anything."""
        from asyncrl.transport.endpoint import digests

        return digests(self.named_parameters_stream())

    # ---- the object-store broker ------------------------------------------------------
    def weights_ref(self) -> dict[str, Any] | None:
        """Rank 0: ``{"refs": [ObjectRef], "bytes": n}``, the weights in the object store
        as one :class:`~asyncrl.broker.payload.PackedWeights` (the ref inside a list so
        that it travels as a ref); other ranks take part in the stream, return None."""
        import ray

        from asyncrl.broker.payload import PackedWeights

        stream = self.named_parameters_stream()
        if self.rank != 0:
            for _ in stream:
                pass
            return None
        # ray.put copies before this returns, so a CPU parameter needs no copy of its
        # own; a transient (unsharded) or GPU tensor is copied to CPU as it arrives.
        packed = PackedWeights(
            (n, t.to("cpu", copy=self.sharded and t.device.type == "cpu")) for n, t in stream
        )
        return {"refs": [ray.put(packed)], "bytes": packed.nbytes}
