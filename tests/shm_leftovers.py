"""Shared-memory files left in /dev/shm by the session's killed processes: the tests
kill engines, actors and drivers by design (SIGKILL, ``ray.kill``), and a killed process
cannot unlink the segments (``psm_*``: vLLM's message queues) or the named semaphores
(``sem.mp-*``: multiprocessing locks) it made. The run's own cleanup
(asyncrl/utils/shm.py) covers the processes a run kills itself; at the session's end
the controller removes the rest: those that appeared during the session and that no
live process has mapped."""

from __future__ import annotations

import contextlib
from pathlib import Path

from asyncrl.utils.shm import PATTERNS, SHM, mapped

__all__ = ["SHM", "entries", "remove_leftovers"]


def entries(shm: Path = SHM) -> set[str]:
    return {p.name for pattern in PATTERNS for p in shm.glob(pattern)}


def remove_leftovers(before: set[str], shm: Path = SHM) -> list[str]:
    """Remove the entries not in ``before`` that no live process maps; their names."""
    gone = sorted(entries(shm) - before - mapped(shm=shm))
    for name in gone:
        with contextlib.suppress(FileNotFoundError):
            (shm / name).unlink()
    return gone
