"""Shared-memory files left in /dev/shm by the session's killed processes: the tests
kill engines, actors and drivers by design (SIGKILL, ``ray.kill``), and a killed process
cannot unlink the segments (``psm_*``: vLLM's message queues) or the named semaphores
(``sem.mp-*``: multiprocessing locks) it made. At the session's end the controller
removes those that appeared during the session and that no live process has mapped."""

from __future__ import annotations

import contextlib
from pathlib import Path

SHM = Path("/dev/shm")
PATTERNS = ("psm_*", "sem.mp-*")


def entries(shm: Path = SHM) -> set[str]:
    return {p.name for pattern in PATTERNS for p in shm.glob(pattern)}


def mapped(shm: Path = SHM) -> set[str]:
    """Names under ``shm`` that a live process has mapped (its /proc/<pid>/maps)."""
    prefix = f"{shm}/"
    names: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            for line in maps.read_text().splitlines():
                fields = line.split(maxsplit=5)  # address perms offset dev inode path
                path = fields[5] if len(fields) == 6 else ""
                if path.startswith(prefix):
                    names.add(path[len(prefix) :].removesuffix(" (deleted)"))
    return names


def remove_leftovers(before: set[str], shm: Path = SHM) -> list[str]:
    """Remove the entries not in ``before`` that no live process maps; their names."""
    gone = sorted(entries(shm) - before - mapped(shm))
    for name in gone:
        with contextlib.suppress(FileNotFoundError):
            (shm / name).unlink()
    return gone
