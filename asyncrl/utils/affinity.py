"""CPU placement of processes and threads (Linux): where the actor's vLLM engine runs
and where its own event loop runs.

Affinity is per thread on Linux; a thread or process started later inherits it from
the thread that starts it.
"""

from __future__ import annotations

import os
from pathlib import Path


def parse_cpu_list(spec: str | int | list) -> set[int]:
    """``"0"``, ``"2-3"``, ``"0,2,4-5"`` (or an int, or a list of these) -> the set of
    CPU ids."""
    if not isinstance(spec, str | int):  # a list (a YAML list arrives as a ListConfig)
        parts = list(spec)
        if not parts:
            raise ValueError("not a CPU list: an empty list (e.g. '0', '0-3', '0,2')")
        return set().union(*(parse_cpu_list(x) for x in parts))
    out: set[int] = set()
    for part in str(spec).replace(" ", "").split(","):
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(f"not a CPU list: {spec!r} (e.g. '0', '0-3', '0,2')") from None
        if first < 0 or last < first:
            raise ValueError(f"not a CPU list: {spec!r} (e.g. '0', '0-3', '0,2')")
        out.update(range(first, last + 1))
    return out


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (vLLM's engine-core and worker processes hang
    below the process that owns the engine)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children(p)
    return out


def children(pid: int) -> list[int]:
    """The processes ``pid`` (any of its threads) started."""
    out = []
    for task in _listdir(f"/proc/{pid}/task"):
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except OSError:
            pass
    return out


def pin_threads(pid: int, cores: set[int], *, skip_main: bool = False) -> int:
    """Pin every thread of process ``pid`` (all but its main thread with
    ``skip_main``) to ``cores``; returns how many."""
    n = 0
    for tid in _listdir(f"/proc/{pid}/task"):
        if skip_main and int(tid) == pid:
            continue
        try:
            os.sched_setaffinity(int(tid), cores)
            n += 1
        except OSError:  # the thread ended meanwhile
            pass
    return n


def pin_tids(tids: list[int], cores: set[int]) -> int:
    """Pin the threads ``tids`` to ``cores``; returns how many (a thread that ended
    meanwhile is skipped)."""
    n = 0
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
            n += 1
        except OSError:
            pass
    return n


def pin_tree(pid: int, cores: set[int]) -> int:
    """Pin every thread of ``pid`` and of its descendants to ``cores``; returns how
    many threads were pinned."""
    return sum(pin_threads(p, cores) for p in process_tree(pid))


def keep_off(cores: set[int], root: int) -> dict[int, set[int]]:
    """Take ``cores`` out of the affinity of every thread of ``root``'s descendants
    (``root`` itself stays as it is). For a driver that started a local Ray these are
    Ray's GCS, raylet and worker processes (the queue's, the learner's, the actors', the
    idle ones); the processes they start later inherit it. A thread that may only run
    on ``cores`` (an engine's) has nowhere else to go and stays. Returns each moved
    thread's affinity before the move (thread id -> cores), for :func:`restore`."""
    moved: dict[int, set[int]] = {}
    for pid in process_tree(root):
        if pid == root:
            continue
        for tid in _listdir(f"/proc/{pid}/task"):
            try:
                mask = os.sched_getaffinity(int(tid))
                rest = mask - cores
                if rest and rest != mask:
                    os.sched_setaffinity(int(tid), rest)
                    moved[int(tid)] = mask
            except OSError:  # the thread ended meanwhile
                pass
    return moved


def restore(saved: dict[int, set[int]]) -> int:
    """Give the threads :func:`keep_off` moved their affinity back (those that ended
    meanwhile are skipped; a thread id the kernel reused is not ours: only a thread
    still on the narrowed cores is touched). Processes started from a moved thread
    while it was moved keep the narrowed affinity. Returns how many were restored."""
    n = 0
    for tid, mask in saved.items():
        try:
            if os.sched_getaffinity(tid) < mask:
                os.sched_setaffinity(tid, mask)
                n += 1
        except OSError:  # ended
            pass
    return n


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
