"""What this machine allows: Linux namespaces (probed once, at first use), a sandbox uid
per concurrent execution, the interpreter and the harness's command line."""

from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from asyncrl.sandbox.settings import MAX_WORKERS

# net: no interfaces but a down loopback; pid: the harness is PID 1 and every process of
# the execution dies with it; mount (implied by --mount-proc): a private view of the
# file system and a /proc that shows only the sandbox's own processes.
NS_FLAGS = ["--net", "--pid", "--fork", "--kill-child", "--mount-proc"]
USERNS_FLAGS = ["--user", "--map-root-user"]  # without root: unprivileged user namespaces
PROBE_TIMEOUT_S = 10.0
UID_BASE = 200_000  # far above login and system accounts; no passwd entry is needed
UID_PIDS = 10_000  # uid blocks per host process: two graders rarely share a uid


class SandboxUnavailable(RuntimeError):
    """This machine cannot run untrusted code safely with these settings."""


@dataclass(frozen=True)
class Isolation:
    kind: str  # "namespaces" (root), "user-namespaces" (no root) or "none"
    prefix: tuple[str, ...]  # the unshare command the harness runs under, or ()
    python: str  # the real interpreter (a venv's symlink would be hidden)
    drop_uid: bool  # whether case children run as a sandbox uid of their own
    expose: tuple[str, ...]  # put back read-only after the host is hidden: the stdlib
    refusal: str = ""  # why nothing may run here (root, no namespaces, no uid to drop to)

    @property
    def namespaces(self) -> bool:
        return bool(self.prefix)


@functools.cache
def detect(use_namespaces: bool = True, python: str = "") -> Isolation:
    """The strongest isolation that works here for ``python`` (default: this interpreter),
    probed once per process."""
    python = os.path.realpath(python or sys.executable)
    stdlib = _base_prefix(python)
    root = os.geteuid() == 0
    unshare = shutil.which("unshare")
    if use_namespaces and unshare:
        flags = NS_FLAGS if root else USERNS_FLAGS + NS_FLAGS
        prefix = (unshare, *flags, "--")
        if _works([*prefix, python, "-I", "-S", "-c", "pass"]):
            kind = "namespaces" if root else "user-namespaces"
            return Isolation(kind, prefix, python, root, (stdlib,))
    # Without a mount namespace the stdlib must be readable by the sandbox uid as it is.
    drop = root and _world_readable(Path(stdlib))
    refusal = ""
    if root and not drop:
        refusal = (
            f"no namespaces here and {stdlib} is not readable by an unprivileged uid: "
            "refusing to run untrusted code as root; allow namespaces (sandbox.namespaces) "
            "or point sandbox.python at an interpreter in a world-readable prefix"
        )
    return Isolation("none", (), python, drop, (), refusal)


def _base_prefix(python: str) -> str:
    r = subprocess.run(
        [python, "-I", "-S", "-c", "import sys; print(sys.base_prefix)"],
        env={}, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
    )  # fmt: skip
    if r.returncode != 0:
        raise SandboxUnavailable(f"{python} does not run: {r.stderr.strip()[-300:]}")
    return os.path.realpath(r.stdout.strip())


def _works(cmd: list[str]) -> bool:
    try:
        r = subprocess.run(cmd, env={}, capture_output=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def _world_readable(path: Path) -> bool:
    """``path`` and every ancestor let others in (o+x): the stdlib imports as nobody."""
    p = path.resolve()
    return all(d.stat().st_mode & stat.S_IXOTH for d in [p, *p.parents])


class UidSlots:
    """Sandbox uids, one per execution in flight in this process: RLIMIT_NPROC counts
    per uid, so two executions must not share one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free = list(range(MAX_WORKERS))
        self._base = UID_BASE + (os.getpid() % UID_PIDS) * MAX_WORKERS

    def take(self) -> int:
        with self._lock:
            if not self._free:
                raise RuntimeError(f"more than {MAX_WORKERS} sandbox executions at once")
            return self._base + self._free.pop(0)

    def give(self, uid: int) -> None:
        with self._lock:
            self._free.append(uid - self._base)


UIDS = UidSlots()
