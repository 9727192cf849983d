"""A learner rank's weights, out to the brokers: the methods the brokers call on a rank
(a Ray actor), held by :class:`~asyncrl.learner.learner.Learner` as ``weights``.

    process-group broker                   this rank (rank 0 sends; the others only take
                                           part in the collective unshard of a sharded
                                           learner)
    start ── attach_broker ──────────────▶ rank 0's SenderSide (self._sender) ─▶ Attached
                                           (direct: dp_rank 0's other TP ranks too)
    publish(V) ── snapshot_weights ───────▶ pack a copy of the weights as V (every rank);
                                           direct (order.tp > 1): each TP rank of
                                           dp_rank 0 packs its own engine shard
    per sync set ── send_weights(SendOrder) ▶ rank 0 (direct: every TP rank of dp_rank 0),
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
        """``tp``: a tensor-parallel learner's ``(tp_rank, learner.tp, layout, local
        stream)`` (asyncrl/learner/dist.py ``tp_layout``, ``stream_local``)."""
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

    def engine_shard(self, tp: int) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
        """This rank's engine TP shard, cut from what it holds: ``(engine name, tensor)``
        for engine rank ``tp_rank`` of ``tp`` (= ``learner.tp``), as the full-tensor plan
        cuts it (asyncrl/transport/reshard.py ``direct_plan``), and what it took:
        ``held_bytes`` (what this rank held to cut it), ``gathered`` (the tensors gathered
        whole), ``exchanged`` (the expert tensors swapped within the ``ep`` group).
        Collective: every rank calls it; a rank of ``dp_rank > 0`` cuts the same shard as
        its group's first. ValueError when the layouts differ."""
        from asyncrl.transport.reshard import direct_plan

        if self._local is None or self._layout is None or tp != self.tp or tp < 2:
            raise ValueError(f"engine TP size {tp}: this learner rank runs learner.tp={self.tp}")
        if self.model_config is None:
            raise ValueError("resharding needs the model's config")
        direct = direct_plan(self.model_config, self._layout(), tp)
        held = {n: t.clone() for n, t in self._local(direct.gather, direct.exchange)}
        held_bytes = sum(t.numel() * t.element_size() for t in held.values())
        shard = [(n, t.clone()) for n, t in direct.shard(self.tp_rank, held)]
        took = {"gathered": sorted(direct.gather), "exchanged": sorted(direct.exchange)}
        return shard, {"held_bytes": held_bytes, **took}

    def shard_digests(self, tp: int) -> dict[str, Any]:
        """Every rank: the digests of :meth:`engine_shard` with its bytes (``nbytes``) and
        what it took (bit-exactness checks against the full-tensor plan)."""
        from asyncrl.transport.endpoint import digests

        shard, took = self.engine_shard(tp)
        nbytes = sum(t.numel() * t.element_size() for _, t in shard)
        return {"tp_rank": self.tp_rank, "digests": digests(shard), "nbytes": nbytes, **took}

    # ---- the process-group broker -----------------------------------------------------
    def attach_broker(self, broker_id: str, broker: Any, settings: BrokerSettings) -> Attached:
        """Rank 0, or a TP rank of ``dp_rank`` 0 that sends its own shard: the sender
        endpoint for ``broker`` (a Ray handle). Attaching again replaces the previous
        broker's. ``Attached.tp``: the engine TP size this rank can send its own shard
        at (``learner.tp`` for a tensor-parallel learner without LoRA, else 1)."""
        self.detach_broker()
        config = self.model_config
        if config is None and hasattr(getattr(self, "model", None), "config"):
            config = self.model.config.to_dict()  # a plain model's
        self._sender = SenderSide.start(broker_id, broker, settings, config, self.tp_rank)
        direct = self.tp > 1 and self._local is not None and config is not None
        return self._sender.attached(os.getpid(), self.tp if direct else 1)

    def snapshot_weights(self, order: SnapshotOrder) -> Snapshot | None:
        """Rank 0: pack the weights as ``order.version`` for the attached broker (a copy:
        the learner may train on once this returns). Other ranks take part in the
        stream and return None. ``order.tp`` > 1: every rank cuts its engine shard
        (collective), and each TP rank of ``dp_rank`` 0 packs its own."""
        if order.tp > 1:
            shard, _ = self.engine_shard(order.tp)
            if self.rank >= order.tp:  # dp_rank > 0: the same shard as its group's first
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
        """Rank 0 (direct: each TP rank of ``dp_rank`` 0): one set's transfer (beside a
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
