"""No process of a run outlives its driver, even a SIGKILLed one.

    driver ──starts──▶ watchdog (own session, not marked)
       │ sets ASYNCRL_RUN=<id> in its environment before Ray starts, so every process
       │ of the run inherits it: GCS, raylet, Ray's agents, workers, vLLM engines
       ▼
    driver exits (any way) ──pidfd readable──▶ watchdog sweeps /proc: SIGKILL every
                                               process whose environment holds the mark,
                                               and every descendant it last saw; then
                                               unlinks the /dev/shm files they had mapped
                                               that no live process maps (utils/shm.py)

The tree is also watched (``TREE_POLL_S``): a process may clobber its own environment
block, as Ray's agents' process titles can (setproctitle reuses argv and environ
memory), and then /proc/<pid>/environ no longer shows the mark. Its pid and start time
were recorded while the driver lived.

A process tree cannot be used: when the driver dies its descendants are re-parented to
PID 1. An environment mark survives re-parenting, and a child's exec keeps it unless
the child scrubs its environment on purpose (none of Ray's or vLLM's do).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

MARK = "ASYNCRL_RUN"
SWEEP_ROUNDS = 20  # a dying raylet may still spawn; sweep until two rounds find nothing
SWEEP_PAUSE_S = 0.25
POLL_S = 0.5  # liveness poll where pidfd_open is missing (Linux < 5.3)
TREE_POLL_S = 2.0  # how often the driver's descendants are recorded


def start(driver_pid: int | None = None) -> str:
    """Mark this process's environment with a new run id and start its watchdog;
    returns the id. Call before Ray starts so that Ray's processes inherit the mark."""
    run_id = uuid.uuid4().hex[:16]
    env = {k: v for k, v in os.environ.items() if k != MARK}  # the watchdog is not marked
    subprocess.Popen(
        [sys.executable, "-m", "asyncrl.utils.watchdog", str(driver_pid or os.getpid()), run_id],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C or a kill of the driver's group spares it
    )  # fmt: skip
    os.environ[MARK] = run_id
    return run_id


def marked(run_id: str) -> list[int]:
    """Pids of live processes whose environment holds ``ASYNCRL_RUN=run_id``."""
    needle = f"{MARK}={run_id}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if needle in env:
            out.append(int(d.name))
    return out


def _started(pid: int) -> str | None:
    """The process's start time (clock ticks since boot): tells a reused pid apart."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> dict[int, str]:
    """pid -> start time of every live descendant of ``pid`` (this watchdog, the
    driver's child too, left out)."""
    from asyncrl.utils.affinity import process_tree

    out = {}
    for p in process_tree(pid)[1:]:
        if p == os.getpid():
            continue
        t = _started(p)
        if t is not None:
            out[p] = t
    return out


def sweep(run_id: str, seen: dict[int, str] | None = None) -> int:
    """SIGKILL every marked process, and every process of ``seen`` (pid -> start time,
    still the same process), until none is left, then remove the shared memory they
    had mapped; returns how many were killed."""
    from asyncrl.utils.shm import mapped, remove_unmapped

    killed, quiet, names = 0, 0, set()
    for _ in range(SWEEP_ROUNDS):
        pids = marked(run_id) + [p for p, t in (seen or {}).items() if _started(p) == t]
        quiet = quiet + 1 if not pids else 0
        if quiet >= 2:
            break
        names |= mapped(pids)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
        time.sleep(SWEEP_PAUSE_S)
    remove_unmapped(names)
    return killed


def wait_for_exit(pid: int, seen: dict[int, str]) -> None:
    """Until ``pid`` exits; meanwhile ``seen`` collects its descendants."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd: poll
        fd = None
    while True:
        if fd is None:
            if not _alive(pid):
                return
            time.sleep(POLL_S)
        elif select.select([fd], [], [], TREE_POLL_S)[0]:  # readable once it has exited
            os.close(fd)
            return
        seen.update(descendants(pid))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the driver's exit ends it
    driver, run_id = int(sys.argv[1]), sys.argv[2]
    seen: dict[int, str] = {}
    wait_for_exit(driver, seen)
    sweep(run_id, seen)


if __name__ == "__main__":
    main()
