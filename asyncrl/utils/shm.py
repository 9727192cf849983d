"""Shared memory that killed processes leave in /dev/shm.

A process that is SIGKILLed cannot unlink what it made there: vLLM's message queues
between an engine core and its separate workers (``psm_*``, tensor-parallel engines) and
multiprocessing's named semaphores (``sem.mp-*``). The file stays until someone unlinks
it, and a run that restarts engines many times fills the tmpfs. Whoever kills such a
process (the actor supervisor, the run's watchdog) notes the names it had mapped
(:func:`mapped`) and removes them once no live process maps them (:class:`Leftovers`,
:func:`remove_unmapped`).

    /proc/<pid>/maps ── mapped(pids) ──▶ names ── the processes are killed ──▶
    remove_unmapped(names): each name no live process maps is unlinked
"""

from __future__ import annotations

import contextlib
import fnmatch
import time
from collections.abc import Iterable
from pathlib import Path

SHM = Path("/dev/shm")
PATTERNS = ("psm_*", "sem.mp-*")
GIVE_UP_S = 60.0  # a name still mapped this long after its owner's death is left alone
RETRY_S = 0.2  # between looks of a waiting clean-up


def ours(name: str) -> bool:
    """A name of the kinds killed processes leave (:data:`PATTERNS`)."""
    return any(fnmatch.fnmatchcase(name, p) for p in PATTERNS)


def mapped(pids: Iterable[int] | None = None, shm: Path = SHM) -> set[str]:
    """Names under ``shm`` of :data:`PATTERNS` that processes ``pids`` (None: every
    live process) have mapped and that are still there, read from their
    /proc/<pid>/maps."""
    prefix = f"{shm}/"
    files = (
        Path("/proc").glob("[0-9]*/maps")
        if pids is None
        else (Path(f"/proc/{p}/maps") for p in pids)
    )
    names: set[str] = set()
    for maps in files:
        with contextlib.suppress(OSError):  # gone, or not ours to read
            for line in maps.read_text().splitlines():
                fields = line.split(maxsplit=5)  # address perms offset dev inode path
                path = fields[5] if len(fields) == 6 else ""
                name = path[len(prefix) :]
                if path.startswith(prefix) and not name.endswith(" (deleted)") and ours(name):
                    names.add(name)
    return names


def remove_unmapped(names: Iterable[str], shm: Path = SHM) -> list[str]:
    """Unlink each of ``names`` (of :data:`PATTERNS`) that exists and that no live
    process maps; returns the names removed."""
    wanted = sorted(n for n in set(names) if ours(n) and (shm / n).exists())
    if not wanted:
        return []
    held = mapped(shm=shm)
    gone = []
    for name in wanted:
        if name in held:
            continue
        with contextlib.suppress(FileNotFoundError):
            (shm / name).unlink()
            gone.append(name)
    return gone


class Leftovers:
    """Names noted when their processes were killed, removed by later :meth:`clean`
    calls once those processes are gone (a SIGKILLed process unmaps on its exit, a
    moment later); a name still mapped :data:`GIVE_UP_S` after it was noted is
    dropped, left to whoever maps it."""

    def __init__(self, shm: Path = SHM, give_up_s: float = GIVE_UP_S):
        self.shm, self.give_up_s = shm, give_up_s
        self.pending: dict[str, float] = {}  # name -> when it was noted

    def note(self, names: Iterable[str]) -> None:
        now = time.monotonic()
        for name in names:
            if ours(name):
                self.pending.setdefault(name, now)

    def clean(self, wait_s: float = 0.0) -> list[str]:
        """Remove the noted names no live process maps; returns them. ``wait_s``: look
        again every :data:`RETRY_S` for that long while some are still mapped (the last
        clean-up of a run, whose killed processes may not have exited yet)."""
        deadline = time.monotonic() + wait_s
        gone: list[str] = []
        while self.pending:
            gone += remove_unmapped(self.pending, self.shm)
            now = time.monotonic()
            for name, noted in list(self.pending.items()):
                if name in gone or not (self.shm / name).exists() or now - noted > self.give_up_s:
                    del self.pending[name]
            if not self.pending or now >= deadline:
                break
            time.sleep(RETRY_S)
        return gone
