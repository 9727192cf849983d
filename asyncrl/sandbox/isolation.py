"""What this machine allows (``sandbox.isolation``), probed once per process, and the
bubblewrap command line of one execution.

    isolation=bwrap   root:     bwrap without a user namespace; case children move to a
                                sandbox uid of their own (the harness keeps CHOWN, KILL,
                                SETUID, SETGID; nothing else)
                      not root: bwrap --unshare-user --disable-userns (unprivileged user
                                namespaces); case children keep the user's uid, no caps
                      either:   new ipc, pid, net, uts, cgroup namespaces; an empty root
                                with /usr, /etc and the interpreter read-only; a minimal /dev;
                                size-limited private tmpfs /tmp, /dev/shm and work dir;
                                the seccomp filter of asyncrl/sandbox/seccomp.py
    isolation=none    no namespaces, no filter: the program runs as this user (root: a
                      sandbox uid), sees the host and its network. Warned at start-up.

``require`` is the start-up check: a ConfigError naming ``sandbox.isolation`` when the
isolation asked for cannot be had here (never a silent fallback)."""

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

from asyncrl.config import ConfigError
from asyncrl.sandbox import seccomp
from asyncrl.sandbox.settings import MAX_WORKERS, SandboxSettings

NAMESPACES = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
              "--unshare-cgroup", "--die-with-parent", "--new-session", "--as-pid-1",
              "--hostname", "sandbox"]  # fmt: skip
USERNS = ["--unshare-user", "--disable-userns"]  # without root
ROOT_CAPS = ["--cap-drop", "ALL"] + [
    a for c in ("CAP_CHOWN", "CAP_KILL", "CAP_SETUID", "CAP_SETGID") for a in ("--cap-add", c)
]
SYSTEM_DIRS = ("usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
COVER_MB = 4  # the private /tmp and /dev/shm
PROBE_TIMEOUT_S = 10.0
UID_BASE = 200_000  # far above login and system accounts; no passwd entry is needed
UID_PIDS = 10_000  # uid blocks per host process: two graders rarely share a uid
UNCONFINED = (
    "sandbox.isolation=none: model-written programs run unconfined, as this run's user, "
    "with the network and every file that user can read; only for trusted code"
)


class SandboxUnavailable(RuntimeError):
    """This machine cannot run untrusted code safely with these settings."""


@dataclass(frozen=True)
class Isolation:
    kind: str  # "bwrap" (root), "bwrap-userns" (no root) or "none"
    bwrap: str  # the bwrap binary, or "" (isolation none)
    python: str  # the real interpreter (a venv's symlink would be hidden)
    drop_uid: bool  # whether case children run as a sandbox uid of their own
    stdlib: str  # the interpreter's prefix: bound read-only into the sandbox
    refusal: str = ""  # why the isolation asked for is not available here

    @property
    def namespaces(self) -> bool:
        return bool(self.bwrap)

    def argv(self, workdir: str, disk_mb: int, seccomp_fd: int) -> list[str]:
        """The bwrap prefix of one execution (empty without isolation)."""
        if not self.bwrap:
            return []
        cmd = [self.bwrap, *NAMESPACES, *(ROOT_CAPS if self.drop_uid else USERNS)]
        for name in SYSTEM_DIRS:
            path = "/" + name
            if os.path.islink(path):
                cmd += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                cmd += ["--ro-bind", path, path]
        cmd += ["--proc", "/proc", "--dev", "/dev"]
        for path, mb in (("/tmp", COVER_MB), ("/dev/shm", COVER_MB), (workdir, disk_mb)):
            cmd += ["--size", str(mb << 20), "--tmpfs", path]
        for parent in reversed(Path(self.stdlib).parents[:-1]):  # a sandbox uid may pass them
            if parent.parts[1] not in (*SYSTEM_DIRS, "tmp"):  # those are mounts already
                cmd += ["--perms", "0755", "--dir", str(parent)]
        cmd += ["--ro-bind", self.stdlib, self.stdlib]  # after /tmp: a prefix there stays
        return [*cmd, "--chdir", workdir, "--seccomp", str(seccomp_fd), "--"]


@functools.cache
def detect(isolation: str = "bwrap", python: str = "") -> Isolation:
    """The isolation asked for, for ``python`` (default: this interpreter), probed once
    per process; ``refusal`` says why it cannot be had."""
    python = os.path.realpath(python or sys.executable)
    stdlib = _base_prefix(python)
    root = os.geteuid() == 0
    if isolation == "none":
        refusal = ""
        if root and not _world_readable(Path(stdlib)):
            refusal = (f"{stdlib} is not readable by an unprivileged uid: refusing to run "
                       "untrusted code as root; set sandbox.python to an interpreter in a "
                       "world-readable prefix")  # fmt: skip
        return Isolation("none", "", python, root, stdlib, refusal)
    kind = "bwrap" if root else "bwrap-userns"
    bwrap = shutil.which("bwrap") or ""
    iso = Isolation(kind, bwrap, python, root, stdlib)
    why = _probe(iso)
    if why:
        return Isolation(kind, "", python, root, stdlib, why)
    return iso


def _probe(iso: Isolation) -> str:
    if not iso.bwrap:
        return "bubblewrap (bwrap) is not installed (Debian: apt-get install bubblewrap)"
    if not seccomp.supported():
        return f"no seccomp filter for this machine ({os.uname().machine})"
    r, w = os.pipe()
    try:
        os.write(w, seccomp.program())
        os.close(w)
        cmd = [*iso.argv("/tmp/probe", 1, r), iso.python, "-I", "-S", "-c", "pass"]
        p = subprocess.run(cmd, env={}, capture_output=True, timeout=PROBE_TIMEOUT_S, pass_fds=(r,))
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bwrap does not start here: {e}"
    finally:
        os.close(r)
    if p.returncode != 0:
        why = p.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return f"bwrap cannot create the namespaces here: {why[0][:200]}"
    return ""


def require(settings: SandboxSettings) -> str:
    """Start-up check for a run that grades programs: ConfigError (one line, naming
    ``sandbox.isolation``) when that isolation is unavailable; prints (stderr, one line)
    and returns the warning for ``isolation=none`` (see ``unconfined_warning``), else ""."""
    try:
        iso = detect(settings.isolation, settings.python)
    except SandboxUnavailable as e:
        raise ConfigError(f"sandbox.python={settings.python!r}: {e}") from None
    if iso.refusal:
        raise ConfigError(f"sandbox.isolation={settings.isolation}: {iso.refusal}")
    warning = unconfined_warning(settings)
    if warning:
        print(f"WARNING: {warning}", file=sys.stderr)
    return warning


def unconfined_warning(settings: SandboxSettings) -> str:
    """The warning a run with ``sandbox.isolation=none`` carries (for summary.json), or ""."""
    return UNCONFINED if settings.isolation == "none" else ""


def _base_prefix(python: str) -> str:
    r = subprocess.run(
        [python, "-I", "-S", "-c", "import sys; print(sys.base_prefix)"],
        env={}, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
    )  # fmt: skip
    if r.returncode != 0:
        raise SandboxUnavailable(f"{python} does not run: {r.stderr.strip()[-300:]}")
    return os.path.realpath(r.stdout.strip())


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
