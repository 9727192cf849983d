"""The trusted supervisor inside the sandbox. Standard library only: it is started as
``python -I -S -B -c <this file's text> <marker>`` (no site-packages, no repository on the
path) and never imports asyncrl.

    parent (grader) ──stdin: job JSON──▶ harness (PID 1 of its namespaces; root if the
                                          parent is root; never runs untrusted code)
         ▲                                 │ per case: fork ─▶ case child: drop uid, rlimits,
         │ channel fd: one JSON frame      │                   exec solution, eval call,
         └─────────────────────────────────┘ ◀── result pipe ── write tagged value, _exit
                                           │ after each case: SIGKILL every descendant

Why this shape: untrusted code only ever runs in case children, which never hold the
channel fd (closed before the solution runs) and, when the harness is root, run under
another uid, so they can neither write the channel nor ptrace/kill the harness. What a
child can send is its own result pipe, which is only a value: the same power as
returning that value. Expected values never enter the sandbox; the parent compares.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import resource
import select
import signal
import sys
import time

# prctl(2) options (linux/prctl.h)
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 1, 4, 38, 36
CAP_VERSION_3 = 0x20080522  # _LINUX_CAPABILITY_VERSION_3 (linux/capability.h)
MAX_DEPTH = 100  # nesting of a returned value; deeper fails the case
KILL_ROUNDS = 200  # sweeps over /proc; a fork bomb is capped by RLIMIT_NPROC anyway
MEMORY_POLL_S = 0.05  # between RLIMIT_AS (per process) and this, a tree holds little more
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")

_libc = ctypes.CDLL(None, use_errno=True)
_os_exit, _os_write, _dumps, _eval, _compile, _exec = (
    os._exit, os.write, json.dumps, eval, compile, exec
)  # fmt: skip  # bound before the solution can patch the modules


def prctl(option: int, arg: int) -> None:
    if _libc.prctl(option, arg, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option})")


# ---- the work dir (under bwrap: a private tmpfs, made by bwrap, owned by root) ------------
def own_workdir(job: dict) -> None:
    """Hand the work dir (already the cwd) to the case uid: root harness only (CAP_CHOWN);
    afterwards the harness itself cannot open it (no CAP_DAC_OVERRIDE), nor needs to."""
    work, uid = job["workdir"], job["uid"]
    if job["namespaces"] and uid is not None:
        os.chmod(work, 0o700)  # while root owns it: the harness has no CAP_FOWNER
        os.chown(work, uid, uid)


# ---- one case, in a forked child --------------------------------------------------------------
def encode(v: object, depth: int = 0) -> list:
    """A plain value as ``[type name, payload]``; exact types only (a subclass of int,
    an object with a custom ``__eq__`` ... raises TypeError, failing the case)."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    t = type(v)
    if v is None or t is bool or t is str:
        return [t.__name__, v]
    if t is int:
        return ["int", str(v)] if abs(v) < 10**4000 else _too_big()
    if t is float:
        return ["float", repr(v)]
    if t is bytes:
        return ["bytes", v.hex()]
    if t is list or t is tuple or t is set or t is frozenset:
        return [t.__name__, [encode(x, depth + 1) for x in v]]
    if t is dict:
        return ["dict", [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in v.items()]]
    raise TypeError(f"returned a {t.__name__}; only plain builtin values can be graded")


def _too_big() -> list:
    raise ValueError("int has more than 4000 digits")


def limit_child(job: dict, result_fd: int) -> None:
    """Everything the case child does before the solution runs (trusted code)."""
    os.closerange(3, result_fd)
    os.closerange(result_fd + 1, 1 << 16)  # the channel and anything else inherited
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    prctl(PR_SET_NO_NEW_PRIVS, 1)  # setuid binaries (su, mount) cannot lift the limits
    lim = job["limits"]
    mb = 1 << 20
    cpu = math.ceil(lim["timeout_s"]) + 1
    pairs = [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (lim["memory_mb"] * mb,) * 2),
        (resource.RLIMIT_FSIZE, (lim["file_mb"] * mb,) * 2),
        (resource.RLIMIT_NOFILE, (lim["open_files"],) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ]
    if job["nproc"] is not None:  # None: it would count every process of this user
        pairs.append((resource.RLIMIT_NPROC, (job["nproc"],) * 2))
    for which, pair in pairs:
        resource.setrlimit(which, pair)
    if job["uid"] is not None:
        os.setgroups([])
        os.setgid(job["uid"])
        os.setuid(job["uid"])
    else:  # no uid to move to (user namespaces, or not root): at least no capabilities
        drop_capabilities()


def drop_capabilities() -> None:
    """capset(2) with every set empty: e.g. no CAP_SYS_PTRACE to open the harness's fds."""
    header = (ctypes.c_uint32 * 2)(CAP_VERSION_3, 0)  # this thread
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable; two words each
    if _libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def run_case(job: dict, call: str, result_fd: int) -> None:
    """In the case child: never returns."""
    try:
        limit_child(job, result_fd)
    except BaseException as e:
        _os_write(2, f"sandbox harness: limits failed: {e}\n".encode())
        _os_exit(71)
    try:
        ns = {"__name__": "solution"}
        _exec(_compile(job["solution"], "solution.py", "exec"), ns)
        payload = {"ok": True, "value": encode(_eval(_compile(call, "<case>", "eval"), ns))}
    except BaseException as e:  # SystemExit, KeyboardInterrupt: this case fails, no more
        try:
            payload = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
        except BaseException:
            payload = {"ok": False, "error": "an exception that cannot be printed"}
    for stream in (sys.stdout, sys.stderr):  # _exit skips the flush the program expects
        try:
            stream.flush()
        except BaseException:
            pass
    try:
        data = _dumps(payload).encode()
        while data:
            data = data[_os_write(result_fd, data) :]
    finally:
        _os_exit(0)


# ---- the harness's loop ---------------------------------------------------------------------
def descendants(root: int) -> list[int]:
    """Every live or zombie process below ``root`` (orphans come back to us: we are PID 1
    of the namespace, or a child subreaper without one)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def reap() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def kill_descendants() -> int:
    """SIGKILL everything below us until nothing is left; returns how many were killed."""
    me, killed = os.getpid(), 0
    if me == 1:  # PID 1 of our own namespace: kill(-1) reaches exactly the namespace, and
        try:  # in one pass, so a fork bomb cannot outrun it
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for _ in range(KILL_ROUNDS):
        pids = descendants(me)
        if not pids:
            return killed
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        reap()
        time.sleep(0.001)  # let the kernel reparent the orphans of what just died
    return killed


def wait_case(pid: int, fd: int, deadline: float, cap: int, memory_mb: int) -> tuple[bytes, str]:
    """The child's result bytes and how it ended: ``exit N``, ``signal NAME``, ``timeout``,
    ``memory limit`` or ``result too large``. Wakes on the result pipe, on the child's
    pidfd, or every MEMORY_POLL_S to add up the memory of the case's process tree."""
    buf, pidfd, status = bytearray(), os.pidfd_open(pid), ""
    watch = [fd, pidfd]
    try:
        while not status:
            left = deadline - time.monotonic()
            if left <= 0:
                status = "timeout"
                break
            ready = select.select(watch, [], [], min(left, MEMORY_POLL_S))[0]
            if fd in ready:
                chunk = os.read(fd, 65536)
                buf += chunk
                if len(buf) > cap:
                    status = "result too large"
                if not chunk:
                    watch = [pidfd]  # EOF; the child may still linger, under the deadline
            if pidfd in ready and not status:
                _, code = os.waitpid(pid, 0)
                return bytes(buf), describe(code)
            if not ready and tree_memory_mb(os.getpid()) > memory_mb:
                status = "memory limit (all processes together)"
        os.kill(pid, signal.SIGKILL)  # reaped by kill_descendants
    finally:
        os.close(pidfd)
    return bytes(buf), status


def tree_memory_mb(root: int) -> float:
    """Resident memory below ``root`` that is not file-backed (statm: resident - shared),
    read from counters without walking page tables, so it stays cheap while a hog runs.
    Copy-on-write pages still shared after fork count once per process (an overcount of
    a few MB per process)."""
    pages = 0
    for pid in descendants(root):
        try:
            with open(f"/proc/{pid}/statm", "rb") as f:
                fields = f.read().split()
            pages += int(fields[1]) - int(fields[2])
        except (OSError, ValueError, IndexError):
            pass  # gone, or a zombie
    return pages * PAGE_SIZE / (1 << 20)


def describe(code: int) -> str:
    if os.WIFSIGNALED(code):
        try:
            return f"signal {signal.Signals(os.WTERMSIG(code)).name}"
        except ValueError:
            return f"signal {os.WTERMSIG(code)}"
    return f"exit {os.waitstatus_to_exitcode(code)}"


def drain(fd: int, buf: bytes, cap: int) -> bytes:
    """What is still in the pipe once every writer is dead."""
    out = bytearray(buf)
    while len(out) <= cap and select.select([fd], [], [], 0.2)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        out += chunk
    return bytes(out)


def grade_cases(job: dict) -> list[dict]:
    deadline = time.monotonic() + job["limits"]["timeout_s"]
    cap, out = job["limits"]["result_bytes"], []
    for call in job["calls"]:
        if time.monotonic() >= deadline:
            out.append({"payload": None, "end": "timeout (not started)"})
            continue
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            run_case(job, call, w)
        os.close(w)
        buf, end = wait_case(pid, r, deadline, cap, job["limits"]["memory_mb"])
        kill_descendants()  # daemons, threads' processes: nothing outlives its case
        buf = drain(r, buf, cap) if end.startswith(("exit", "signal")) else buf
        os.close(r)
        ok = end.startswith(("exit", "signal")) and len(buf) <= cap
        out.append({"payload": buf.decode("utf-8", "replace") if ok else None, "end": end})
    return out


def main() -> None:
    job = json.loads(sys.stdin.buffer.read())
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    channel = job["channel_fd"]
    os.environ.pop("PWD", None)  # bwrap's --chdir sets it; the program gets PATH, LANG, HOME
    own_workdir(job)
    if not job["namespaces"]:
        prctl(PR_SET_CHILD_SUBREAPER, 1)  # setsid'd orphans come back to us, not to init
    prctl(PR_SET_DUMPABLE, 0)  # same-uid children cannot ptrace us or open our fds
    try:
        cases = grade_cases(job)
    finally:
        kill_descendants()
    frame = _dumps({"nonce": job["nonce"], "cases": cases}).encode()
    while frame:
        frame = frame[os.write(channel, frame) :]
    os.close(channel)


if __name__ == "__main__":
    main()
