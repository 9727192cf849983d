"""tests/shm_leftovers.py: a segment a killed process left is removed at the session's
end; one that was there before, and one a live process maps, are kept."""

from __future__ import annotations

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
    time.sleep(60)
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
