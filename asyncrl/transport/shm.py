"""Same-host road of a weight sync: buckets in POSIX shared memory, names on the wire.

    sender (learner rank 0)                          each receiver
    ShmArena.alloc: pack() writes every bucket       post arrive = held|layout|host_identity()
      into its own segment (the shadow itself)
    send: every receiver on this host (same          header: per bucket [segment, offset, nbytes]
      host_identity), group on gloo? ─────────────▶    MappedSegment: open read-only, check
      yes: the header names the segments;              owner, mode 0600, size, offset; map;
           sparse payloads staged in segments          copy into the held copy
           of their own for this sync
      no: the group's wire (one log line why)        post done
    wait for every done ─▶ unlink this sync's staged segments
    a shadow dropped ─▶ its segments unlinked (finalizer); release() / exit ─▶ all unlinked

A segment is written once (a shadow version is immutable; a staged payload belongs to
one sync) and read only while the sender waits for the acknowledgements, so no
receiver ever reads a segment being written. Names carry the sender's pid and 128
random bits (``asyncrl-w-<pid>-<hex>``); a sender killed outright leaves its segments,
which the next arena on the host unlinks (:func:`sweep_orphans`).
"""

from __future__ import annotations

import atexit
import functools
import logging
import mmap
import os
import re
import secrets
import socket
import stat
import threading
import warnings
import weakref
from typing import Any

import torch

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "asyncrl-w-"
NAME_RE = re.compile(r"^asyncrl-w-(\d+)-([0-9a-f]{32})$")
# Share of /dev/shm left to others (vLLM's shared-memory message queues, NCCL,
# multiprocessing): weights never take the last quarter.
SHM_RESERVE_FRACTION = 0.25
MODES = ("auto", "off")  # broker.shm


@functools.cache
def host_identity() -> str:
    """This host as seen from inside this process: the kernel's boot id, the host name
    and the device of ``/dev/shm`` (two containers on one kernel have their own
    /dev/shm). Empty when it cannot be read: an empty identity never matches."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        dev = os.stat(SHM_DIR).st_dev
    except OSError:
        return ""
    return f"{boot}/{socket.gethostname()}/{dev}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_orphans(directory: str = SHM_DIR) -> list[str]:
    """Unlink this user's segments whose sender process is gone; returns their names."""
    gone = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return gone
    for e in entries:
        m = NAME_RE.match(e.name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        try:
            if e.stat(follow_symlinks=False).st_uid == os.geteuid():
                os.unlink(e.path)
                gone.append(e.name)
        except OSError:
            pass
    return gone


def _unlink(path: str, live: dict[str, int], lock: threading.Lock) -> None:
    with lock:
        live.pop(os.path.basename(path), None)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ShmArena:
    """The sender's shared-memory segments: one per packed bucket (alive as long as the
    bucket tensor) and one per staged payload (unlinked by the sync that staged it).

    ``limit_bytes`` caps what the arena holds at once (None: only /dev/shm's free space,
    less the larger of :data:`SHM_RESERVE_FRACTION` of it and ``reserve_bytes``: e.g.
    Ray's object store, whose pages in /dev/shm are taken only as it fills). A bucket
    that does not fit is packed into ordinary memory and goes over the wire; the first
    such refusal is logged once."""

    def __init__(
        self, limit_bytes: int | None = None, directory: str = SHM_DIR, reserve_bytes: int = 0
    ):
        self.limit_bytes = limit_bytes
        self.reserve_bytes = reserve_bytes
        self.directory = directory
        self._live: dict[str, int] = {}  # name -> bytes
        self._by_ptr: dict[int, tuple[str, int]] = {}  # data_ptr -> (name, bytes)
        self._lock = threading.Lock()
        self._said: set[str] = set()
        swept = sweep_orphans(directory)
        if swept:
            log.info("unlinked %d shared-memory segment(s) of dead senders", len(swept))
        atexit.register(self.release)

    @property
    def nbytes(self) -> int:
        return sum(self._live.values())

    def names(self) -> list[str]:
        return list(self._live)

    def room(self, nbytes: int) -> str | None:
        """Why ``nbytes`` more do not fit (None: they do)."""
        if self.limit_bytes is not None and self.nbytes + nbytes > self.limit_bytes:
            return f"the arena's limit of {self.limit_bytes} B ({self.nbytes} B held)"
        try:
            st = os.statvfs(self.directory)
        except OSError as e:
            return f"{self.directory} unreadable ({e})"
        free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        keep = max(SHM_RESERVE_FRACTION * total, self.reserve_bytes)
        if free - nbytes < keep:
            return (
                f"{self.directory} has {free} B free of {total} B and keeps {keep:.0f} B for "
                f"others (Ray's object store, {SHM_RESERVE_FRACTION:.0%} at least); {nbytes} B "
                f"more do not fit"
            )
        return None

    def _say(self, key: str, line: str) -> None:
        if key not in self._said:
            self._said.add(key)
            log.warning("%s", line)

    def _segment(self, nbytes: int) -> torch.Tensor | None:
        """A fresh ``nbytes`` segment mapped read-write as uint8 (None: no room)."""
        why = self.room(nbytes)
        if why is not None:
            self._say("room", f"weight sync: buckets that do not fit go over the wire: {why}")
            return None
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(16)}"
        path = os.path.join(self.directory, name)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as e:
            self._say("open", f"weight sync: no segment in {self.directory} ({e}); the wire")
            return None
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            # Reserve the pages now: a full tmpfs then fails here (ENOSPC), not as a
            # SIGBUS when pack() writes through the mapping.
            os.posix_fallocate(fd, 0, nbytes)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            os.unlink(path)
            self._say("map", f"weight sync: a {nbytes} B segment failed ({e}); the wire")
            return None
        finally:
            os.close(fd)
        flat = torch.frombuffer(mm, dtype=torch.uint8)
        with self._lock:
            self._live[name] = nbytes
            self._by_ptr[flat.data_ptr()] = (name, nbytes)
        ptr = flat.data_ptr()
        weakref.finalize(mm, self._forget, path, ptr)  # the last view gone: unlink
        return flat

    def _forget(self, path: str, ptr: int) -> None:
        with self._lock:
            self._by_ptr.pop(ptr, None)
        _unlink(path, self._live, self._lock)

    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements of ``dtype``: a segment, or ordinary memory when none fits."""
        flat = self._segment(numel * dtype.itemsize) if numel > 0 else None
        if flat is None:
            return torch.empty(numel, dtype=dtype)
        return flat.view(dtype)

    def segment_of(self, t: torch.Tensor) -> tuple[str, int] | None:
        """(name, bytes) of the segment that is exactly ``t``'s memory; None otherwise."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        hit = self._by_ptr.get(t.data_ptr())
        if hit is None or hit[1] != t.numel() * t.element_size():
            return None
        return hit

    def stage(self, payload: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """Copy ``payload`` (uint8) into a segment of its own; (name, its tensor), or None
        when it does not fit. The caller unlinks it with :meth:`drop`."""
        flat = self._segment(payload.numel()) if payload.numel() > 0 else None
        if flat is None:
            return None
        flat.copy_(payload)
        return self.segment_of(flat)[0], flat  # type: ignore[index]

    def drop(self, name: str) -> None:
        """Unlink ``name`` now (receivers that mapped it keep their mapping)."""
        _unlink(os.path.join(self.directory, name), self._live, self._lock)

    def release(self) -> None:
        """Unlink every segment (the sender keeps its mappings until it drops them)."""
        for name in list(self._live):
            self.drop(name)


class SegmentError(ValueError):
    """A header named a segment that cannot be read as announced."""


def map_segment(
    name: Any, offset: Any, nbytes: Any, directory: str = SHM_DIR, *, private: bool = False
) -> torch.Tensor:
    """``[offset, offset + nbytes)`` of segment ``name`` as a uint8 tensor that owns the
    mapping (unmapped when the last view goes), checked before any byte is read: a
    well-formed name in ``directory``, a regular file owned by this user with no access
    for others, and the range inside it. Shared and read-only by default; ``private``:
    copy-on-write, so the caller may write to it (deltas) without touching the sender's
    bytes. Raises :class:`SegmentError` naming what is wrong."""
    if not (isinstance(name, str) and NAME_RE.match(name)):
        raise SegmentError(f"not a weight segment name: {str(name)[:80]!r}")
    if not (isinstance(offset, int) and isinstance(nbytes, int)) or offset < 0 or nbytes < 0:
        raise SegmentError(f"segment {name}: bad range offset={offset!r} nbytes={nbytes!r}")
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise SegmentError(f"segment {path}: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise SegmentError(f"segment {path}: not a regular file of this user")
        if st.st_mode & 0o077:
            raise SegmentError(f"segment {path}: mode {st.st_mode & 0o777:o}, not 600")
        if offset + nbytes > st.st_size:
            raise SegmentError(
                f"segment {path}: [{offset}, {offset + nbytes}) outside its {st.st_size} B"
            )
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        # No page is mapped here: the first read of each 64 KiB maps its pages (the
        # kernel's fault-around), read-only, shared with the sender's, and a write to a
        # private mapping copies only the page it touches. Populating the mapping up
        # front (MAP_POPULATE, MADV_POPULATE_READ) walks it page by page: on an 18 MB
        # bucket that took longer than reading every byte through the faults.
        if private:
            flags, prot = mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE
        else:
            flags, prot = mmap.MAP_SHARED, mmap.PROT_READ
        mm = mmap.mmap(fd, st.st_size, flags, prot)
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # a shared mapping is read-only on purpose
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset)
