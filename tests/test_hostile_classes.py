"""The hostile classes that go around a per-process limit or a shared namespace (System V
shared memory left behind, memfd written past the memory limit, nested user namespaces,
results whose hashes collide, signal games, AF_VSOCK), and what the sandbox itself looks
like from inside. Each program earns the reward only if its attack works; each test
asserts the score 0, the error that names what stopped it, nothing left on the host
(no shared memory segment, no process, no memory held) and an unharmed next grading."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from asyncrl.sandbox import SandboxSettings, detect, grade_with
from asyncrl.sandbox.hostile import CASES, CORRECT, check, leftovers, new_tag, program

LIMITS = SandboxSettings.defaults(timeout_s=1.0, memory_mb=64)
ERRORS = {  # what the first failing case says
    "sysv_shm": "shmget: Operation not permitted",
    "memfd_hog": "PermissionError: [Errno 1] Operation not permitted",
    "nested_userns": "user namespace refused",
    "signal_games": "timeout",
    "vsock": "Address family not supported",
}
SHMEM_SLACK_MB = 40  # other processes on a shared machine move Shmem a little

pytestmark = pytest.mark.skipif(
    not detect("bwrap").namespaces, reason="bubblewrap cannot isolate here"
)


def shm_segments() -> list[str]:
    return Path("/proc/sysvipc/shm").read_text().splitlines()[1:]


def shmem_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no Shmem line in /proc/meminfo")


def grade_watching_the_gil(src: str) -> tuple[object, float, float]:
    """Grade ``src`` while another thread ticks every 5 ms: the grade, the ticker's
    longest gap and the grading thread's own CPU seconds (the sandbox runs in other
    processes, so that is the grader's reading and comparing; immune to other load)."""
    gaps, stop = [0.0], threading.Event()

    def tick() -> None:
        last = time.monotonic()
        while not stop.is_set():
            time.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    t = threading.Thread(target=tick)
    t.start()
    cpu = time.thread_time()
    try:
        g = grade_with(src, CASES, LIMITS)
    finally:
        cpu = time.thread_time() - cpu
        stop.set()
        t.join()
    return g, max(gaps), cpu


@pytest.mark.parametrize("name", [*ERRORS, "hash_collision"])
def test_new_hostile_class_is_contained(name):
    segments, shmem = shm_segments(), shmem_mb()
    tag = new_tag()
    g, longest_gap, cpu_s = grade_watching_the_gil(program(name, tag))
    c = check(name, g, tag, LIMITS.timeout_s)
    assert c.contained, (c.reasons, g)
    assert g.reward == 0
    if name == "hash_collision":  # a wrong value, read in linear time: quadratic reading
        # held the GIL for ~13 s per case; here about 0.1 s of CPU alone (1.15 s once on
        # the AMD host in the suite) and a 0.01-0.2 s gap (0.95 s there)
        assert g.cases[0].got.startswith("set(") and g.cases[1].got.startswith("dict(")
        assert cpu_s < 3.0 and longest_gap < 2.0 and g.wall_s < 5.0, (cpu_s, longest_gap)
    else:
        assert ERRORS[name] in g.error, g
    assert shm_segments() == segments  # `ipcs -m` unchanged
    assert shmem_mb() < shmem + SHMEM_SLACK_MB
    assert leftovers(tag, g.run_id) == []
    assert grade_with(CORRECT, CASES, LIMITS).reward == 1.0


def test_what_a_program_sees_inside():
    src = """import os
DEV = {'core', 'fd', 'full', 'null', 'ptmx', 'pts', 'random', 'shm', 'stderr', 'stdin',
       'stdout', 'tty', 'urandom', 'zero'}
def f():
    status = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines()
                  if ':\\t' in l)
    cgroup = open('/proc/self/cgroup').read().splitlines()
    return [status['CapEff'].strip(), status['NoNewPrivs'].strip(), status['Seccomp'].strip(),
            os.uname().nodename, [c for c in cgroup if c.startswith('0::')],
            sorted(set(os.listdir('/dev')) - DEV),
            [d for d in ('/sys', '/work', '/home', '/opt', '/var', '/mnt') if os.path.exists(d)]]
"""
    # no capabilities, no_new_privs, seccomp mode 2 (filter), own hostname, the root of
    # its own cgroup namespace, only the minimal /dev, none of the host's other trees
    want = ["0000000000000000", "1", "2", "sandbox", ["0::/"], [], []]
    g = grade_with(src, [{"call": "f()", "expected": want}], LIMITS)
    assert g.reward == 1.0, g
