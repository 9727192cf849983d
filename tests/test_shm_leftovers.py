"""Shared memory that killed processes leave: tests/shm_leftovers.py removes at the
session's end a segment a killed process left, and keeps one that was there before and
one a live process maps; asyncrl/utils/shm.py, as the actor supervisor and the run's
watchdog use it, removes what the processes they kill had mapped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from multiprocessing import shared_memory

import pytest
from shm_leftovers import SHM, entries, remove_leftovers

pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")

# a child makes a segment, keeps it from the resource tracker (as vLLM does), prints its
# name and waits to be killed
LEAKER = textwrap.dedent("""
    import sys, time
    from multiprocessing import resource_tracker, shared_memory
    s = shared_memory.SharedMemory(create=True, size=4096)
    resource_tracker.unregister(s._name, "shared_memory")
    print(s.name, flush=True)
    time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 60)
""")


def test_a_killed_processs_segment_goes_and_live_or_older_ones_stay():
    older = shared_memory.SharedMemory(create=True, size=4096)
    older.close()  # unmapped: kept only for being there before
    live = shared_memory.SharedMemory(create=True, size=4096)
    p = subprocess.Popen([sys.executable, "-c", LEAKER], stdout=subprocess.PIPE, text=True)
    try:
        leaked = p.stdout.readline().strip()
        assert leaked.startswith("psm_") and (SHM / leaked).exists()
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        # "before": what is there now, less this test's own two (the other tests' files,
        # a worker beside this one included, are never at stake)
        gone = remove_leftovers(entries() - {leaked, live.name})
        assert leaked in gone and not (SHM / leaked).exists()
        assert live.name not in gone and (SHM / live.name).exists()  # mapped here
        assert older.name not in gone and (SHM / older.name).exists()
    finally:
        p.stdout.close()
        live.close()
        for s in (older, live):
            s.unlink()


def leaker(env: dict[str, str] | None = None, hold_s: float = 60) -> tuple[subprocess.Popen, str]:
    """A child holding a segment it made (:data:`LEAKER`) for ``hold_s`` seconds, then
    exiting without unlinking it, and the segment's name."""
    p = subprocess.Popen([sys.executable, "-c", LEAKER, str(hold_s)], stdout=subprocess.PIPE,
                         text=True, env=env)  # fmt: skip
    name = p.stdout.readline().strip()
    assert name.startswith("psm_") and (SHM / name).exists()
    return p, name


def reap(*procs: subprocess.Popen) -> None:
    for c in procs:
        if c.poll() is None:
            c.kill()
            c.wait()
        c.stdout.close()


def test_a_killed_engines_segments_are_noted_by_pid_and_removed_once_unmapped():
    """asyncrl/utils/shm.py, as the actor supervisor uses it: the names a process maps
    are read from its pid; while it lives they stay, after its SIGKILL they go; a name
    a live process maps stays through :meth:`Leftovers.clean` until it gives up on it."""
    from asyncrl.utils.shm import Leftovers, mapped, remove_unmapped

    p, leaked = leaker()
    live = shared_memory.SharedMemory(create=True, size=4096)
    try:
        assert mapped([p.pid]) == {leaked}  # only the child's own
        assert remove_unmapped([leaked]) == [] and (SHM / leaked).exists()  # alive
        left = Leftovers(give_up_s=0.0)
        left.note([leaked, live.name, "not_ours.txt"])
        assert set(left.pending) == {leaked, live.name}
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        assert left.clean() == [leaked] and not (SHM / leaked).exists()
        assert (SHM / live.name).exists() and left.pending == {}  # mapped here: given up
    finally:
        reap(p)
        live.close()
        live.unlink()


def test_the_supervisor_removes_what_a_dead_actors_engine_had_mapped():
    """``ActorSupervisor._kill``'s cleanup (asyncrl/fault/actors.py): the names from the
    actor's ``pids()`` and those its leftover children map are noted; the children are
    killed; the next ``clean`` removes them."""
    from asyncrl.fault.actors import kill_leftovers, shm_of
    from asyncrl.utils.shm import Leftovers

    p, leaked = leaker()
    q, recorded = leaker()  # died before the kill: only its recorded name is known
    try:
        os.kill(q.pid, signal.SIGKILL)
        q.wait(timeout=30)
        pids = {"host": os.uname().nodename, "children": {p.pid: psutil_name(p.pid)},
                "shm": [recorded]}  # fmt: skip
        assert shm_of({**pids, "host": "elsewhere"}) == set()
        names = shm_of(pids)
        assert names == {leaked, recorded}
        left = Leftovers()
        left.note(names)
        assert kill_leftovers(pids) == [p.pid]
        p.wait(timeout=30)
        assert sorted(left.clean()) == sorted(names)
        assert not (SHM / leaked).exists() and not (SHM / recorded).exists()
    finally:
        reap(p, q)


def psutil_name(pid: int) -> str:
    import psutil

    return psutil.Process(pid).name()


def test_the_watchdogs_sweep_kills_the_marked_and_removes_their_segments():
    """asyncrl/utils/watchdog.py ``sweep``: a process carrying the run's mark is killed
    and the segment it had mapped is unlinked; an unmarked holder's segment stays."""
    import uuid

    from asyncrl.utils import watchdog

    run_id = uuid.uuid4().hex[:16]
    p, leaked = leaker(dict(os.environ, **{watchdog.MARK: run_id}))
    q, kept = leaker()  # not of the run
    try:
        assert watchdog.sweep(run_id) >= 1
        assert p.wait(timeout=30) == -signal.SIGKILL and not (SHM / leaked).exists()
        assert q.poll() is None and (SHM / kept).exists()
    finally:
        reap(p, q)
        for name in (leaked, kept):
            with contextlib.suppress(FileNotFoundError):
                (SHM / name).unlink()


def test_the_last_clean_up_waits_for_a_holder_to_exit():
    """``Leftovers.clean(wait_s)`` (the supervisor's ``close``): a noted segment still
    mapped by a process that is about to exit is removed once it has, within the wait;
    without the wait it stays noted."""
    from asyncrl.utils.shm import Leftovers

    p, leaked = leaker(hold_s=1.0)
    try:
        left = Leftovers()
        left.note([leaked])
        assert left.clean() == [] and set(left.pending) == {leaked}  # still mapped
        assert left.clean(wait_s=30) == [leaked] and not (SHM / leaked).exists()
        assert left.pending == {} and p.wait(timeout=30) == 0
    finally:
        reap(p)
        with contextlib.suppress(FileNotFoundError):
            (SHM / leaked).unlink()
