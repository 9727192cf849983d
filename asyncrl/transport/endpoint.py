"""Long-lived ends of the weight transport: one per process, many groups each.

The broker forms one process group per *sync set* (the actors that receive the
same update together) and keeps it while the set recurs. These endpoints own
those groups on each side, so a caller only names a group by key:

    learner rank 0: SenderEndpoint               vLLM worker: ReceiverEndpoint
      snapshot(V, stream) -> shadows[V]            start(key, host, port, rank, ...)
      open(key, world) (port 0: store picks) ──┐     └─ thread: join group `key` (once)
      send(key, V, base, mode) ───────────────┴──▶      receive() into the held copy
                                                   poll()  -> running | done | failed
                                                   apply(load) -> load(V's tensors)

The worker side receives in a background thread so that generation goes on
during the transfer (a vLLM ``collective_rpc`` blocks the engine while it
runs): only ``apply`` needs the engine paused. Held copy, groups and the
received-but-not-loaded version survive between syncs; a failed group is
closed and forgotten (after a :class:`TransferError` a group is unusable).
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.transport.broadcast import SendStats, WeightSender
from asyncrl.transport.buckets import DEFAULT_BUCKET_MB, pack
from asyncrl.transport.delta import Mode, ShadowStore
from asyncrl.transport.group import TransferError, _resolve_backend, make_group
from asyncrl.transport.receiver import HeldCopy, WeightReceiver

NamedTensors = Iterable[tuple[str, torch.Tensor]]


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
    wait, so a wedged send turns into an error instead of a hung learner."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        backend: str = "auto",
        timeout_s: float = 60.0,
        join_timeout_s: float | None = None,
        bucket_mb: float = DEFAULT_BUCKET_MB,
        shadow_device: str | None = None,
        max_versions: int = 4,
    ):
        self.host = host
        self.backend = _resolve_backend(backend)
        self.timeout_s = timeout_s
        self.join_timeout_s = join_timeout_s if join_timeout_s is not None else timeout_s
        self.bucket_mb = bucket_mb
        default_device = "cuda" if self.backend == "nccl" else "cpu"
        self.shadow_device = torch.device(shadow_device or default_device)
        self.shadows = ShadowStore(max_versions)
        self.senders: dict[str, WeightSender] = {}
        self._lock = threading.Lock()
        self.lock_timeout_s = self.join_timeout_s + 2 * self.timeout_s

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
                version, pack(named_tensors, self.bucket_mb, self.shadow_device, transient)
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

    def open(self, key: str, world_size: int, on_listening: Callable[[int], None]) -> None:
        """Host group ``key``: bind a free port, report it, block until all joined."""
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
        self.senders[key] = WeightSender(group, self.shadows, self.bucket_mb, self.shadow_device)

    def send(self, key: str, version: int, base: int, mode: Mode | str) -> SendStats:
        """Bring group ``key`` (all holding ``base``) to ``version``; a failure closes it."""
        sender = self.senders.get(key)
        if sender is None:
            raise KeyError(f"no group {key!r} (open it first); have {sorted(self.senders)}")
        with self._locked(f"send of version {version} to group {key}"):
            try:
                return sender.send(version, None, receiver_version=base, mode=mode)
            except TransferError:
                self.close(key)
                raise

    def close(self, key: str) -> None:
        sender = self.senders.pop(key, None)
        if sender is not None:
            sender.group.close()

    def close_all(self) -> None:
        for key in list(self.senders):
            self.close(key)


@dataclass
class _Fault:
    """Test hook: at payload ``bucket`` of the next receive, ``kill`` this process
    (SIGKILL, like an OOM kill) or ``stall`` for ``seconds`` (a stuck peer)."""

    kind: str
    bucket: int
    seconds: float = 0.0


class ReceiverEndpoint:
    """A vLLM worker's end: groups by key, one held copy shared by all of them,
    one receive at a time in a background thread.

        start() ─▶ thread: join `key` (first use) ─▶ receive() ─▶ status done | failed
        poll()  ─▶ the status (never blocks)
        apply(load) ─▶ load(tensors of the received version) ─▶ loaded_version

    The received tensors are views into the held copy (or fresh buffers without
    ``hold_copy``); they stay untouched until the next ``start``.
    """

    def __init__(self) -> None:
        self._receivers: dict[str, WeightReceiver] = {}
        self._held = HeldCopy()
        self._received: tuple[int, list[tuple[str, torch.Tensor]]] | None = None
        self.loaded_version: int | None = None
        self._loaded_digests: dict[str, str] | None = None
        self._thread: threading.Thread | None = None
        self._status: dict[str, Any] = {"state": "idle"}
        self._fault: _Fault | None = None

    @property
    def held_version(self) -> int:
        return self._held.version

    def start(
        self,
        key: str,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float,
        join_timeout_s: float | None = None,
        backend: str = "auto",
        hold_copy: bool = True,
    ) -> None:
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError(f"a receive is still running ({self._status})")
        self._status = {"state": "running", "key": key, "rank": rank, "since": time.time()}
        self._received = None  # the new receive writes into the buffers those views share
        args = (key, host, port, rank, world_size, timeout_s, join_timeout_s, backend, hold_copy)
        self._thread = threading.Thread(
            target=self._run, args=args, name=f"asyncrl-recv-{key}", daemon=True
        )
        self._thread.start()

    def _run(
        self,
        key: str,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float,
        join_timeout_s: float | None,
        backend: str,
        hold_copy: bool,
    ) -> None:
        t0 = time.perf_counter()
        rx = self._receivers.get(key)
        try:
            if rx is None:
                group = make_group(
                    host, port, rank, world_size, timeout_s, backend, join_timeout_s=join_timeout_s
                )
                rx = WeightReceiver(group, hold_copy=hold_copy, on_bucket=self._on_bucket)
                self._receivers[key] = rx
            rx.adopt(self._held)
            version, tensors = rx.receive()
        except Exception as e:  # noqa: BLE001 - every failure is reported through poll()
            if rx is not None:
                self._held = rx.held()  # a receive that failed mid-payload dropped it
            self.close(key)
            self._status = _failed(key, rank, e, time.perf_counter() - t0)
            return
        finally:
            self._fault = None
        self._held = rx.held()
        self._received = (version, tensors)
        s = rx.last_stats
        assert s is not None
        self._status = {
            "state": "done",
            "key": key,
            "rank": rank,
            "version": version,
            "base_version": s.base_version,
            "mode": s.mode,
            "bytes": s.bytes_received,
            "buckets_skipped": s.buckets_skipped,
            "seconds": time.perf_counter() - t0,
        }

    def _on_bucket(self, i: int) -> None:
        fault = self._fault
        if fault is None or i != fault.bucket:
            return
        self._fault = None
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(fault.seconds)

    def poll(self) -> dict[str, Any]:
        return {**self._status, "held": self._held.version, "loaded": self.loaded_version}

    def apply(
        self, load: Callable[[list[tuple[str, torch.Tensor]]], None], with_digests: bool = False
    ) -> dict[str, Any]:
        """Hand the received version to ``load`` (in place, engine paused by the caller)."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("apply() while a receive is running")
        if self._received is None:
            raise RuntimeError("apply() with nothing received")
        version, tensors = self._received
        t0 = time.perf_counter()
        load(tensors)
        self.loaded_version = version
        # Digests of exactly what was handed to the loader, taken before anything
        # (the next receive) can touch those buffers.
        self._loaded_digests = digests(tensors) if with_digests else None
        self._received = None
        return {"version": version, "tensors": len(tensors), "seconds": time.perf_counter() - t0}

    def loaded_digests(self) -> dict[str, Any]:
        return {"version": self.loaded_version, "digests": self._loaded_digests}

    def inject_fault(self, kind: str, bucket: int, seconds: float = 0.0) -> None:
        if kind not in ("kill", "stall"):
            raise ValueError(f"fault kind must be kill or stall, got {kind!r}")
        self._fault = _Fault(kind, bucket, seconds)

    def close(self, key: str) -> None:
        rx = self._receivers.pop(key, None)
        if rx is not None:
            rx.group.close()

    def close_all(self) -> None:
        for key in list(self._receivers):
            self.close(key)


def _failed(key: str, rank: int, e: BaseException, seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {
        "state": "failed",
        "key": key,
        "rank": rank,
        "error": f"{type(e).__name__}: {e}",
        "seconds": seconds,
    }
    if isinstance(e, TransferError):
        out.update(peer_ranks=list(e.peer_ranks), bucket=e.bucket, version=e.version)
    return out
