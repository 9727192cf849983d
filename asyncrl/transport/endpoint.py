"""Long-lived ends of the weight transport: one per process, many groups each.

The broker forms one process group per *sync set* (the actors that receive the
same update together) and keeps it while the set recurs. These endpoints own
those groups on each side, so a caller only names a group by key:

    learner rank 0: SenderEndpoint               vLLM worker: ReceiverEndpoint
      snapshot(V, stream) -> shadows[V]            sync(JoinSpec, load) (one call):
      open(key, world) (port 0: store picks) ──┐     join group `key` (first use)
      send(key, V, base, mode) ───────────────┴──▶   receive into the held copy
                                                     load(V's tensors) in place
                                                   ─▶ ReceiveReport

The worker's ``sync`` runs inside one vLLM ``collective_rpc``, so the engine takes
no step while it runs (the actor pauses generation around it per its update
mode). Held copy and groups survive between syncs; a failed group is closed and
forgotten (after a :class:`TransferError` a group is unusable).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from typing import Any

import torch

from asyncrl.transport.broadcast import SendStats, WeightSender
from asyncrl.transport.buckets import DEFAULT_BUCKET_MB, PackedModel, pack
from asyncrl.transport.delta import Mode, ShadowStore
from asyncrl.transport.group import TransferError, make_group, resolve_backend
from asyncrl.transport.receiver import HeldCopy, WeightReceiver
from asyncrl.transport.reshard import plan_for
from asyncrl.transport.shm import MODES as SHM_MODES
from asyncrl.transport.shm import ShmArena
from asyncrl.transport.spec import NO_VERSION, JoinSpec, ReceiveReport
from asyncrl.transport.tp_send import TPShardSender

NamedTensors = Iterable[tuple[str, torch.Tensor]]
log = logging.getLogger(__name__)


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes (dtype and shape are checked separately)."""
    flat = t.detach().reshape(-1).contiguous()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()[:32]


def digests(named: NamedTensors) -> dict[str, str]:
    """Per-tensor ``dtype/shape/sha256``: equal strings mean bit-identical tensors."""
    return {n: f"{t.dtype}/{tuple(t.shape)}/{tensor_digest(t)}" for n, t in named}


class SenderEndpoint:
    """Learner rank 0's end of every group: one shadow store shared by one
    :class:`WeightSender` per group. ``snapshot`` and ``send`` take one lock (a
    snapshot rewrites the shadows a send reads); ``lock_timeout_s`` bounds the
    wait, so a wedged send turns into an error instead of a hung learner.

    ``shm="auto"`` (``broker.shm``; the transport's own users opt in): shadows are packed
    into shared-memory segments (:class:`~asyncrl.transport.shm.ShmArena`, at most
    ``shm_limit_bytes`` when set, leaving ``shm_reserve_bytes`` of /dev/shm free), and a sync whose receivers are all on this host reads
    them from there (asyncrl/transport/shm.py); ``"off"``: the group's wire only.
    Shared memory needs gloo and CPU shadows; otherwise one log line says why not.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        backend: str = "auto",
        timeout_s: float = 60.0,
        join_timeout_s: float | None = None,
        bucket_mb: float = DEFAULT_BUCKET_MB,
        shadow_device: str | None = None,
        max_versions: int = 4,
        model_config: dict[str, Any] | None = None,
        shm: str = "off",
        shm_limit_bytes: int | None = None,
        shm_reserve_bytes: int = 0,
    ):
        self.host = host
        self.model_config = model_config  # the HF config: what a resharding plan needs
        self.backend = resolve_backend(backend)
        self.timeout_s = timeout_s
        self.join_timeout_s = join_timeout_s if join_timeout_s is not None else timeout_s
        self.bucket_mb = bucket_mb
        default_device = "cuda" if self.backend == "nccl" else "cpu"
        self.shadow_device = torch.device(shadow_device or default_device)
        self.shadows = ShadowStore(max_versions)
        self.senders: dict[str, WeightSender] = {}
        # (engine TP size, version) -> (the full shadow they came from, one pack per rank)
        self._shards: dict[tuple[int, int], tuple[PackedModel, list[PackedModel]]] = {}
        self._lock = threading.Lock()
        self.lock_timeout_s = self.join_timeout_s + 2 * self.timeout_s
        self.shm = self._arena(shm, shm_limit_bytes, shm_reserve_bytes)

    def _arena(self, mode: str, limit_bytes: int | None, reserve_bytes: int) -> ShmArena | None:
        if mode not in SHM_MODES:
            raise ValueError(f"shm must be one of {SHM_MODES}, got {mode!r}")
        if mode == "off":
            return None
        if self.backend != "gloo" or self.shadow_device.type != "cpu":
            log.warning(
                "weight sync: no shared memory (backend %s, shadows on %s): it carries CPU "
                "buckets over gloo only", self.backend, self.shadow_device,
            )  # fmt: skip
            return None
        return ShmArena(limit_bytes, reserve_bytes=reserve_bytes)

    def _alloc(self) -> Callable[[int, torch.dtype], torch.Tensor] | None:
        return self.shm.alloc if self.shm is not None else None

    @contextmanager
    def _locked(self, what: str):
        if not self._lock.acquire(timeout=self.lock_timeout_s):
            raise TransferError(f"{what}: the sender stayed busy for {self.lock_timeout_s:.0f}s")
        try:
            yield
        finally:
            self._lock.release()

    @torch.no_grad()
    def snapshot(
        self,
        version: int,
        named_tensors: NamedTensors,
        retain: Iterable[int] | None = None,
        with_digests: bool = False,
        transient: bool = True,
    ) -> dict[str, Any]:
        """Pack ``named_tensors`` (consumed once; the caller may change its weights
        as soon as this returns) as ``version``. ``retain``: versions receivers
        still hold (others are dropped first, so memory peaks at one fresh pack).
        ``transient``: a yielded tensor may change once the next is requested
        (an FSDP unshard stream), so each is copied as it arrives."""
        with self._locked(f"snapshot of version {version}"):
            t0 = time.perf_counter()
            if retain is not None:
                self.shadows.retain(set(retain))
            packed = self.shadows.put(
                version,
                pack(named_tensors, self.bucket_mb, self.shadow_device, transient, self._alloc()),
            )
            info: dict[str, Any] = {
                "version": version,
                "nbytes": packed.manifest.nbytes,
                "buckets": len(packed.buckets),
                "pack_seconds": time.perf_counter() - t0,
                "shadow_bytes": self.shadows.nbytes(),
                "shadow_versions": self.shadows.versions(),
            }
            if with_digests:
                info["digests"] = digests(packed.named_tensors())
            return info

    def open(
        self, key: str, world_size: int, on_listening: Callable[[int], None], tp: int = 1
    ) -> None:
        """Host group ``key``: bind a free port, report it, block until all joined.
        ``tp`` > 1: ranks ``1..tp-1`` are this learner's other senders, each sending
        its own engine shard (:meth:`join_tp`, :meth:`send_own`)."""
        self.close(key)
        group = make_group(
            self.host,
            0,
            0,
            world_size,
            self.timeout_s,
            self.backend,
            join_timeout_s=self.join_timeout_s,
            on_listening=on_listening,
        )
        if tp > 1:
            self.senders[key] = TPShardSender(
                group, tp, self.shadows, self.bucket_mb, self.shadow_device
            )
            return
        self.senders[key] = WeightSender(
            group, self.shadows, self.bucket_mb, self.shadow_device, self.shm
        )

    def join_tp(self, key: str, host: str, port: int, rank: int, world_size: int, tp: int):
        """The sender of engine shard ``rank`` (> 0) joins group ``key``, hosted by rank 0."""
        self.close(key)
        group = make_group(
            host, port, rank, world_size, self.timeout_s, self.backend,
            join_timeout_s=self.join_timeout_s,
        )  # fmt: skip
        self.senders[key] = TPShardSender(
            group, tp, self.shadows, self.bucket_mb, self.shadow_device
        )

    def send_own(
        self,
        key: str,
        version: int,
        base: int,
        mode: Mode | str,
        arrive_timeout_s: float | None = None,
        with_digests: bool = False,
    ) -> SendStats:
        """A tensor-parallel learner's rank: send this rank's shard of ``version`` (its
        shadows hold only that: ``snapshot`` of its ``engine_shard``) to the workers of
        its engine TP rank in group ``key``, every TP rank at once
        (asyncrl/transport/tp_send.py); a failure closes the group. ``with_digests``:
        the shard's digests in the stats (``shard_digests``, this rank's alone)."""
        sender = self.senders.get(key)
        if not isinstance(sender, TPShardSender):
            raise KeyError(f"no tensor-parallel group {key!r}; have {sorted(self.senders)}")
        with self._locked(f"send of version {version} to group {key}"):
            try:
                stats = sender.send_own(version, base, mode, arrive_timeout_s)
            except TransferError:
                self.close(key)
                raise
        if with_digests:
            own = self.shadows.get(version)
            stats.shard_digests = [digests(own.named_tensors())] if own is not None else None
        return stats

    def send(
        self,
        key: str,
        version: int,
        base: int,
        mode: Mode | str,
        arrive_timeout_s: float | None = None,
        shards: int = 0,
        with_digests: bool = False,
    ) -> SendStats:
        """Bring group ``key`` (all holding ``base``) to ``version``; a failure closes it.
        ``arrive_timeout_s``: how long the receivers may take to enter (default: the
        group's timeout). ``shards`` > 1: the members are engines of that many TP
        workers, each worker gets only its shard (asyncrl/transport/reshard.py);
        ``with_digests`` then returns each shard's digests in the stats."""
        sender = self.senders.get(key)
        if sender is None:
            raise KeyError(f"no group {key!r} (open it first); have {sorted(self.senders)}")
        with self._locked(f"send of version {version} to group {key}"):
            try:
                if shards <= 1:
                    return sender.send(
                        version, None, receiver_version=base, mode=mode,
                        arrive_timeout_s=arrive_timeout_s,
                    )  # fmt: skip
                t0 = time.perf_counter()
                packs = self.shard_packs(version, shards)
                if packs is None:
                    raise KeyError(f"version {version} is not in the shadow store")
                bases = self.shard_packs(base, shards) or [None] * shards
                stats = sender.send_shards(version, packs, bases, base, mode, arrive_timeout_s)
                stats.pack_seconds = time.perf_counter() - t0 - stats.wait_seconds - stats.seconds
                if with_digests:
                    stats.shard_digests = [digests(p.named_tensors()) for p in packs]
                return stats
            except TransferError:
                self.close(key)
                raise

    def shard_packs(self, version: int, tp: int) -> list[PackedModel] | None:
        """Shadow ``version`` resharded for ``tp`` engine ranks (one pack per rank, in
        engine parameter names), built once per shadow; None without its shadow."""
        full = self.shadows.get(version) if version != NO_VERSION else None
        for k in [k for k in self._shards if self.shadows.get(k[1]) is None]:
            del self._shards[k]  # its full shadow was dropped
        if full is None:
            return None
        cached = self._shards.get((tp, version))
        if cached is not None and cached[0] is full:
            return cached[1]
        if self.model_config is None:
            raise ValueError("resharding needs the model's config on the sender")
        named = dict(full.named_tensors())
        plan = plan_for(self.model_config, [(n, tuple(t.shape)) for n, t in named.items()], tp)
        packs = [
            pack(plan.shard(r, named), self.bucket_mb, self.shadow_device, alloc=self._alloc())
            for r in range(tp)
        ]
        self._shards[(tp, version)] = (full, packs)
        return packs

    def close(self, key: str) -> None:
        sender = self.senders.pop(key, None)
        if sender is not None:
            sender.group.close()

    def close_all(self) -> None:
        for key in list(self.senders):
            self.close(key)

    def release(self) -> None:
        """Close every group and unlink every shared-memory segment (the endpoint's end)."""
        self.close_all()
        if self.shm is not None:
            self.shm.release()


class ReceiverEndpoint:
    """A vLLM worker's end: groups by key, one held copy shared by all of them.

        sync(spec, load) ─▶ join `key` (first use) ─▶ receive ─▶ load(tensors) ─▶ report

    One call does the whole sync and never raises for a transfer failure: the report
    says what failed where. Every wait inside is bounded by the spec's timeouts.
    ``on_bucket(i)`` (if set) runs just before payload ``i`` is posted (progress).
    """

    def __init__(self) -> None:
        self._receivers: dict[str, WeightReceiver] = {}
        self._held = HeldCopy()
        self.loaded_version: int | None = None
        self._loaded_digests: dict[str, str] | None = None
        self.on_bucket: Callable[[int], None] | None = None
        self.last_report: ReceiveReport | None = None  # of the last join or sync, for callers
        # that cannot take a return value (vLLM's weight-transfer calls answer None)

    @property
    def held_version(self) -> int:
        return self._held.version

    def sync(
        self,
        spec: JoinSpec,
        load: Callable[[list[tuple[str, torch.Tensor]]], None],
        with_digests: bool = False,
        load_shard: Callable[[list[tuple[str, torch.Tensor]]], None] | None = None,
    ) -> ReceiveReport:
        """Receive group ``spec.key``'s next sync and hand it to ``load`` (in place: the
        caller keeps the engine from stepping meanwhile); a resharded sync's tensors
        (this worker's shard, in engine parameter names) go to ``load_shard``."""
        t0 = time.perf_counter()
        try:
            version, tensors, nbytes, sharded = self._receive(spec)
            if sharded and load_shard is None:
                raise TransferError("a resharded sync reached a worker that cannot load shards")
        except Exception as e:  # noqa: BLE001 - every failure goes back in the report
            self.last_report = _failed(spec.rank, self._held.version, e, time.perf_counter() - t0)
            return self.last_report
        t1 = time.perf_counter()
        (load_shard if sharded and load_shard is not None else load)(tensors)
        t2 = time.perf_counter()
        self.loaded_version = version
        # Digests of exactly what was handed to the loader, before anything (the next
        # receive) can touch those buffers.
        self._loaded_digests = digests(tensors) if with_digests else None
        self.last_report = ReceiveReport(
            ok=True, rank=spec.rank, version=version, held=self._held.version, bytes=nbytes,
            seconds=t1 - t0, reload_seconds=t2 - t1, digests=self._loaded_digests,
        )  # fmt: skip
        return self.last_report

    def joined(self, key: str) -> bool:
        return key in self._receivers

    def join(self, spec: JoinSpec) -> None:
        """Join group ``spec.key`` now (nothing when joined already); a failure is
        raised and kept as :attr:`last_report`."""
        if spec.key in self._receivers:
            return
        t0 = time.perf_counter()
        try:
            group = make_group(
                spec.host, spec.port, spec.rank, spec.world_size, spec.timeout_s,
                spec.backend, join_timeout_s=spec.join_timeout_s,
            )  # fmt: skip
        except Exception as e:
            self.last_report = _failed(spec.rank, self._held.version, e, time.perf_counter() - t0)
            raise
        rx = WeightReceiver(group, hold_copy=spec.hold_copy, on_bucket=self._progress)
        self._receivers[spec.key] = rx

    def _receive(self, spec: JoinSpec) -> tuple[int, list[tuple[str, torch.Tensor]], int, bool]:
        rx = None
        try:
            self.join(spec)
            rx = self._receivers[spec.key]
            rx.adopt(self._held)
            version, tensors = rx.receive()
        except Exception:
            if rx is not None:
                self._held = rx.held()  # a receive that failed mid-payload dropped it
            self.close(spec.key)
            raise
        self._held = rx.held()
        assert rx.last_stats is not None
        return version, tensors, rx.last_stats.bytes_received, rx.shard is not None

    def _progress(self, i: int) -> None:
        if self.on_bucket is not None:
            self.on_bucket(i)

    def loaded_digests(self) -> dict[str, Any]:
        return {"version": self.loaded_version, "digests": self._loaded_digests}

    def close(self, key: str) -> None:
        rx = self._receivers.pop(key, None)
        if rx is not None:
            rx.group.close()

    def close_all(self) -> None:
        for key in list(self._receivers):
            self.close(key)


def _failed(rank: int, held: int, e: BaseException, seconds: float) -> ReceiveReport:
    out = ReceiveReport(ok=False, rank=rank, held=held, seconds=seconds)
    out.error = f"{type(e).__name__}: {e}"
    if isinstance(e, TransferError):
        out.peer_ranks, out.bucket = tuple(e.peer_ranks), e.bucket
        out.version = e.version if e.version is not None else NO_VERSION
    return out
