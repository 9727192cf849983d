"""A side process group for weight transfer, and the errors it raises.

The group never touches torch's default group: rank 0 (the learner's sender)
hosts a ``TCPStore``; everyone builds a ``ProcessGroupGloo`` (CPU) or
``ProcessGroupNCCL`` (CUDA) on it. The store also carries a little control
traffic that lets a failure name its culprit instead of hanging:

* ``arrive/<seq>/<rank>``: a rank entered sync ``seq`` (value: the version it
  holds and its bucket layout's fingerprint). The sender waits for every arrival *before* any collective, so a
  receiver that never calls ``receive`` is named after ``timeout_s`` and no
  collective is left dangling.
* ``hb/<rank>``: ``"<beat>|<phase>|<seconds in phase>"``, written by a
  :class:`Heartbeat` thread every ``HEARTBEAT_S`` while its rank is inside a
  sync; the phase is ``wait`` while the rank sits in a collective and ``work``
  otherwise. After a collective fails, the ranks with no ``done``/``fail``
  report are judged: a frozen beat means dead (or frozen); a live beat stuck in
  ``work`` for ``SILENCE_S`` means alive but not taking part (stuck).
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
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from asyncrl.transport.spec import HEADER_BUCKET

# Heartbeat period: frequent enough that a dead peer is named within a second,
# rare enough (a store round trip each) to cost nothing next to a transfer.
HEARTBEAT_S = 0.1
# A peer whose counter did not move for this long is silent: 5 missed beats, so a
# live process briefly starved of CPU on a busy box is not mistaken for a dead one.
SILENCE_S = 5 * HEARTBEAT_S
# Pending connections the store's socket queues (every receiver joins at once).
LISTEN_BACKLOG = 128
# Polling period for CUDA work, whose wait() does not block the CPU.
_CUDA_POLL_S = 0.001


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
    port: int = 0  # the store's port on the sender's host
    _side_store: dist.Store | None = None
    _stopped_beat: threading.Thread | None = None  # the last Heartbeat's thread, not joined

    def settle_heartbeat(self) -> None:
        """Join the last sync's heartbeat thread (told to stop; it ends after at most one
        store write), so that only one thread uses :meth:`side_store` at a time. Bounded: a
        thread stuck on a dead store is a daemon and must not hold us up."""
        thread, self._stopped_beat = self._stopped_beat, None
        if thread is not None and thread.is_alive():
            thread.join(timeout=10 * HEARTBEAT_S)

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
        self.settle_heartbeat()
        try:
            self.pg.shutdown()
        except Exception:  # noqa: BLE001 - already broken groups may refuse to shut down
            pass


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago on ``host`` (bind to 0, read it, release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def bound_store(
    host: str, port: int, world_size: int, master: bool, join: datetime.timedelta
) -> dist.TCPStore:
    """The group's store (also the learner ranks' FSDP group's, learner/dist.py). torch's
    TCPStore server listens on every interface; this one listens on ``host`` only (its own socket, handed over as
    ``master_listen_fd``): loopback for a local run, so no other host can reach the
    rendezvous (docs/security.md)."""
    if not master:
        return dist.TCPStore(host, port, world_size, False, timeout=join)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own does
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(
        host, port, world_size, True, timeout=join, wait_for_workers=False,
        master_listen_fd=sock.detach(),  # the store owns (and closes) the fd now
    )  # fmt: skip


def _local_ip(peer: str) -> str:
    """This host's address on the route to ``peer`` (``peer`` itself when local)."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))  # UDP: picks the route, sends nothing
        return s.getsockname()[0]


def resolve_backend(backend: str) -> str:
    """``auto`` -> ``nccl`` where CUDA and NCCL are there, else ``gloo``; a backend this
    process cannot run raises ValueError."""
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
    on_listening: Callable[[int], None] | None = None,
) -> TransferGroup:
    """Join the weight-transfer group at ``host:port`` as ``rank`` of ``world_size``.

    Rank 0 hosts the store, so it must be the sender. Blocks until all ranks
    have joined or ``join_timeout_s`` (default ``timeout_s``; processes that are
    still starting up may need longer) passes, then raises
    :class:`TransferError`. ``timeout_s`` bounds every later store wait and
    collective.

    Rank 0 may pass ``port=0``: the store binds a free port (no race with other
    processes picking the same one) and ``on_listening(port)`` is called with it
    before the rendezvous blocks, so the caller can tell the other ranks where to
    connect. The port is also kept in :attr:`TransferGroup.port`.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world_size {world_size}")
    kind = resolve_backend(backend)
    timeout = datetime.timedelta(seconds=timeout_s)
    join_s = timeout_s if join_timeout_s is None else join_timeout_s
    join = datetime.timedelta(seconds=join_s)
    others = [r for r in range(world_size) if r != rank]
    if port == 0 and rank != 0:
        raise ValueError("only rank 0 (which hosts the store) may ask for port 0")
    try:
        store = bound_store(host, port, world_size, rank == 0, join)
        port = store.port
        if on_listening is not None:
            on_listening(port)
        pg_store = dist.PrefixStore("pg", store)
        if kind == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = join
            device = torch.device("cuda", torch.cuda.current_device())
            pg: dist.Backend = dist.ProcessGroupNCCL(pg_store, rank, world_size, opts)
        else:
            device = torch.device("cpu")
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = join
            # gloo's pairs listen on this address, not on what the hostname resolves to
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=_local_ip(host))]
            pg = dist.ProcessGroupGloo(pg_store, rank, world_size, opts)
        pg._set_default_timeout(timeout)
        store.set_timeout(timeout)
    except Exception as e:  # noqa: BLE001 - any setup failure means some peer never joined
        raise TransferError(
            f"rank {rank}/{world_size} could not join the {kind} group at {host}:{port} "
            f"within {join_s:.1f}s: {e}",
            peer_ranks=others if rank == 0 else (0,),
        ) from e
    return TransferGroup(pg, store, rank, world_size, timeout_s, device, kind, port=port)


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


def _beat(store: dist.Store, key: str) -> tuple[str, str, float] | None:
    """(beat, phase, seconds in phase) of a heartbeat key, or None if never written."""
    if not store.check([key]):
        return None
    beat, phase, age = store.get(key).decode().split("|")
    return beat, phase, float(age)


def diagnose(group: TransferGroup, seq: int, ranks: Iterable[int]) -> tuple[list[int], list[int]]:
    """Among ``ranks`` that neither finished nor reported a failure of sync ``seq``:
    ``(silent, stuck)``. Silent: the heartbeat stayed frozen for ``SILENCE_S`` (dead
    or frozen process). Stuck: alive, but outside any collective (phase ``work``)
    for at least ``SILENCE_S`` while the others wait on it."""
    ranks = list(ranks)
    first = {r: _beat(group.store, group.key("hb", rank=r)) for r in ranks}
    time.sleep(SILENCE_S)
    silent, stuck = [], []
    for r in ranks:
        if group.has(group.key("done", seq, r)) or group.has(group.key("fail", seq, r)):
            continue
        now = _beat(group.store, group.key("hb", rank=r))
        if now is None or first[r] is None or now[0] == first[r][0]:
            silent.append(r)
        elif now[1] == "work" and now[2] >= SILENCE_S:
            stuck.append(r)
    return silent, stuck


def silent_ranks(group: TransferGroup, seq: int, ranks: Iterable[int]) -> list[int]:
    """Ranks that are dead or frozen (see :func:`diagnose`)."""
    return diagnose(group, seq, ranks)[0]


class Heartbeat:
    """Context manager: a daemon thread writes ``hb/<rank>`` every ``HEARTBEAT_S``.

    Loop: sleep on a stop event for ``HEARTBEAT_S`` → ``store.set(hb/<rank>,
    "<beat>|<phase>|<seconds in phase>")`` on its own store connection (so it
    never queues behind the caller) → repeat until ``__exit__`` sets the event.
    The caller marks its phase with :meth:`enter` (``wait`` inside a collective,
    ``work`` otherwise). A store error ends the thread quietly: the main
    thread's collectives will report the real failure. ``__exit__`` only tells the
    thread to stop; the join waits for the next Heartbeat of the group (or its
    ``close``: :meth:`TransferGroup.settle_heartbeat`), off the sync's path.
    """

    def __init__(self, group: TransferGroup):
        self._group = group
        self._store = group.side_store()
        self._key = group.key("hb", rank=group.rank)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"hb-rank{group.rank}", daemon=True)
        self._beats = 0
        self.phase = "work"
        self._since = time.monotonic()

    def enter(self, phase: str) -> None:
        """Mark the caller's phase (plain assignments: safe without a lock)."""
        self.phase, self._since = phase, time.monotonic()

    def _write(self) -> None:
        self._beats += 1
        age = time.monotonic() - self._since
        self._store.set(self._key, f"{self._beats}|{self.phase}|{age:.3f}")

    def _run(self) -> None:
        try:
            while not self._stop.wait(HEARTBEAT_S):
                self._write()
        except Exception:  # noqa: BLE001 - see class docstring
            return

    def __enter__(self) -> Heartbeat:
        self._group.settle_heartbeat()  # the side store is ours alone from here
        try:
            self._write()  # beat once now: a peer that checks early sees us alive
        except Exception:  # noqa: BLE001 - see class docstring
            return self
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._group._stopped_beat = self._thread
