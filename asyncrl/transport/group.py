"""A side process group for weight transfer, and the errors it raises.

The group never touches torch's default group: rank 0 (the learner's sender)
hosts a ``TCPStore``; everyone builds a ``ProcessGroupGloo`` (CPU) or
``ProcessGroupNCCL`` (CUDA) on it. The store also carries a little control
traffic that lets a failure name its culprit instead of hanging:

* ``arrive/<seq>/<rank>``: a rank entered sync ``seq`` (value: the version it
  holds). The sender waits for every arrival *before* any collective, so a
  receiver that never calls ``receive`` is named after ``timeout_s`` and no
  collective is left dangling.
* ``hb/<rank>``: a counter a :class:`Heartbeat` thread bumps every
  ``HEARTBEAT_S`` while its rank is inside a sync. After a collective fails, the
  silent ranks (heartbeat frozen, no ``done``/``fail`` report) are the dead ones.
* ``done/<seq>/<rank>``, ``fail/<seq>/<rank>``: a rank finished or gave up.

Every collective is waited on with a deadline (:func:`wait_work`). After a
:class:`TransferError` the group is unusable (collectives may be half-matched):
rebuild it with :func:`make_group` on a fresh port.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Heartbeat period: frequent enough that a dead peer is named within a second,
# rare enough (a store round trip each) to cost nothing next to a transfer.
HEARTBEAT_S = 0.1
# A peer whose counter did not move for this long is silent: 5 missed beats, so a
# live process briefly starved of CPU on a busy box is not mistaken for a dead one.
SILENCE_S = 5 * HEARTBEAT_S
# Polling period for CUDA work, whose wait() does not block the CPU.
_CUDA_POLL_S = 0.001
HEADER_BUCKET = -1  # bucket index used in errors raised before any bucket moved


class TransferError(RuntimeError):
    """A weight transfer failed; names the peer rank(s), the bucket and the version."""

    def __init__(
        self,
        reason: str,
        peer_ranks: Iterable[int] = (),
        bucket: int | None = None,
        version: int | None = None,
    ):
        self.reason = reason
        self.peer_ranks = tuple(sorted(peer_ranks))
        self.bucket = bucket
        self.version = version
        where = []
        if version is not None:
            where.append(f"version {version}")
        if bucket is not None:
            where.append("header" if bucket == HEADER_BUCKET else f"bucket {bucket}")
        if self.peer_ranks:
            where.append(f"peer rank(s) {list(self.peer_ranks)}")
        super().__init__(f"weight transfer failed ({', '.join(where) or 'setup'}): {reason}")


@dataclass
class TransferGroup:
    """A process group plus the store it was built on; rank 0 is the sender."""

    pg: dist.Backend
    store: dist.Store
    rank: int
    world_size: int
    timeout_s: float
    device: torch.device
    backend: str  # "gloo" or "nccl"
    _side_store: dist.Store | None = None

    def side_store(self) -> dist.Store:
        """A second connection to the store, for the heartbeat thread (made once)."""
        if self._side_store is None:
            self._side_store = self.store.clone()
        return self._side_store

    def key(self, kind: str, seq: int | None = None, rank: int | None = None) -> str:
        parts = [kind] + [str(p) for p in (seq, rank) if p is not None]
        return "/".join(parts)

    def has(self, key: str) -> bool:
        return self.store.check([key])

    def close(self) -> None:
        """Best effort: tear the backend down (unblocks nothing that already timed out)."""
        try:
            self.pg.shutdown()
        except Exception:  # noqa: BLE001 - already broken groups may refuse to shut down
            pass


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago on ``host`` (bind to 0, read it, release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _resolve_backend(backend: str) -> str:
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be auto, gloo or nccl, got {backend!r}")
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise ValueError("backend='nccl' needs CUDA and a torch build with NCCL")
    return backend


def make_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    backend: str = "auto",
    *,
    join_timeout_s: float | None = None,
) -> TransferGroup:
    """Join the weight-transfer group at ``host:port`` as ``rank`` of ``world_size``.

    Rank 0 hosts the store, so it must be the sender. Blocks until all ranks
    have joined or ``join_timeout_s`` (default ``timeout_s``; processes that are
    still starting up may need longer) passes, then raises
    :class:`TransferError`. ``timeout_s`` bounds every later store wait and
    collective.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world_size {world_size}")
    kind = _resolve_backend(backend)
    timeout = datetime.timedelta(seconds=timeout_s)
    join_s = timeout_s if join_timeout_s is None else join_timeout_s
    join = datetime.timedelta(seconds=join_s)
    others = [r for r in range(world_size) if r != rank]
    try:
        store = dist.TCPStore(
            host, port, world_size, rank == 0, timeout=join, wait_for_workers=False
        )
        pg_store = dist.PrefixStore("pg", store)
        if kind == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = join
            device = torch.device("cuda", torch.cuda.current_device())
            pg: dist.Backend = dist.ProcessGroupNCCL(pg_store, rank, world_size, opts)
        else:
            device = torch.device("cpu")
            pg = dist.ProcessGroupGloo(pg_store, rank, world_size, join)
        pg._set_default_timeout(timeout)
        store.set_timeout(timeout)
    except Exception as e:  # noqa: BLE001 - any setup failure means some peer never joined
        raise TransferError(
            f"rank {rank}/{world_size} could not join the {kind} group at {host}:{port} "
            f"within {join_s:.1f}s: {e}",
            peer_ranks=others if rank == 0 else (0,),
        ) from e
    return TransferGroup(pg, store, rank, world_size, timeout_s, device, kind)


def wait_work(group: TransferGroup, work: dist.Work, deadline_s: float) -> None:
    """Block until ``work`` completes; raise RuntimeError once ``deadline_s`` (monotonic) passes."""
    remaining = deadline_s - time.monotonic()
    if group.backend == "gloo":
        work.wait(datetime.timedelta(seconds=max(remaining, 0.001)))
        return
    # NCCL's wait() only orders streams; poll so the CPU side really has a deadline.
    while not work.is_completed():
        if time.monotonic() > deadline_s:
            group.pg.abort()
            raise RuntimeError(f"NCCL collective timed out after {group.timeout_s:.1f}s")
        time.sleep(_CUDA_POLL_S)
    work.wait()


def _beat(store: dist.Store, key: str) -> str | None:
    return store.get(key).decode() if store.check([key]) else None


def silent_ranks(group: TransferGroup, seq: int, ranks: Iterable[int]) -> list[int]:
    """Ranks among ``ranks`` that neither finished nor reported a failure of sync ``seq``
    and whose heartbeat stayed frozen for ``SILENCE_S``: the likely dead or stuck peers."""
    ranks = list(ranks)
    first = {r: _beat(group.store, group.key("hb", rank=r)) for r in ranks}
    time.sleep(SILENCE_S)
    silent = []
    for r in ranks:
        if group.has(group.key("done", seq, r)) or group.has(group.key("fail", seq, r)):
            continue
        if _beat(group.store, group.key("hb", rank=r)) == first[r]:
            silent.append(r)
    return silent


class Heartbeat:
    """Context manager: a daemon thread bumps ``hb/<rank>`` every ``HEARTBEAT_S``.

    Loop: sleep on a stop event for ``HEARTBEAT_S`` → ``store.add(hb/<rank>, 1)``
    on its own store connection (so it never queues behind the caller) → repeat
    until ``__exit__`` sets the event. A store error ends the thread quietly: the
    main thread's collectives will report the real failure.
    """

    def __init__(self, group: TransferGroup):
        self._store = group.side_store()
        self._key = group.key("hb", rank=group.rank)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"hb-rank{group.rank}", daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.wait(HEARTBEAT_S):
                self._store.add(self._key, 1)
        except Exception:  # noqa: BLE001 - see class docstring
            return

    def __enter__(self) -> Heartbeat:
        try:
            self._store.add(self._key, 1)  # beat once now: a peer that checks early sees us alive
        except Exception:  # noqa: BLE001 - see class docstring
            return self
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if not self._thread.is_alive():
            return
        # Bounded: a thread stuck on a dead store is a daemon and must not hold us up.
        self._thread.join(timeout=10 * HEARTBEAT_S)
