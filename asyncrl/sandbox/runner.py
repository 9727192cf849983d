"""One execution on the host side: a fresh temp dir, the harness under bubblewrap in a
session of its own, its output capped, its channel read, the whole tree killed at the
deadline, the temp dir removed.

    run_harness ── Popen(start_new_session) ──▶ bwrap ──▶ harness (see _harness.py)
        │ hands bwrap the seccomp filter on a pipe (asyncrl/sandbox/seccomp.py)
        │ waits (selectors) on: merged stdout/stderr pipe (capped) and the channel pipe
        │ wakes on: data, EOF of the channel (the harness is done), or the deadline
        └ then: SIGKILL the process group (bwrap --die-with-parent and the PID namespace
          take everything inside down with it)
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from asyncrl.sandbox import seccomp
from asyncrl.sandbox.isolation import Isolation
from asyncrl.sandbox.settings import SandboxSettings

log = logging.getLogger(__name__)
HARNESS_SOURCE = (Path(__file__).parent / "_harness.py").read_text()
STARTUP_GRACE_S = 3.0  # interpreter start, namespace set-up and the kill sweeps, loaded box
EXIT_GRACE_S = 1.0  # the harness has sent its frame; it only has to exit
MARKER = "asyncrl-sandbox-"  # in every sandbox process's command line: tests scan /proc
CHANNEL_CAP = 64 << 20  # a frame bigger than every case's result cap together is forged
FILTER = seccomp.program() if seccomp.supported() else b""


@dataclass
class RawRun:
    frame: dict | None  # the harness's frame, None if it sent none or a bad one
    output: bytes  # stdout+stderr of the whole execution, at most output_bytes
    error: str  # why there is no frame, or a limit that ended the run
    wall_s: float
    run_id: str
    isolation: str


def run_harness(
    solution: str, calls: list[str], limits: SandboxSettings, iso: Isolation, uid: int | None
) -> RawRun:
    run_id = secrets.token_hex(8)
    nonce = secrets.token_hex(16)
    workdir = tempfile.mkdtemp(prefix=f"{MARKER}{run_id}-")
    t0 = time.monotonic()
    try:
        if uid is not None:
            os.chown(workdir, uid, uid)
        job = {
            "solution": solution,
            "calls": calls,
            "nonce": nonce,
            "uid": uid,
            "workdir": workdir,
            "namespaces": iso.namespaces,
            "nproc": _nproc(limits, iso, uid),
            "limits": {
                k: getattr(limits, k)
                for k in ("timeout_s", "memory_mb", "file_mb", "open_files", "processes")
            }
            | {"result_bytes": limits.result_bytes},
        }
        frame_bytes, output, error = _spawn(job, limits, iso, workdir, run_id)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    frame = None
    if not error:
        frame, error = _parse_frame(frame_bytes, nonce, len(calls))
    return RawRun(frame, output, error, time.monotonic() - t0, run_id, iso.kind)


def _nproc(limits: SandboxSettings, iso: Isolation, uid: int | None) -> int | None:
    """RLIMIT_NPROC of a case child: it counts per uid and user namespace, so it bounds
    the case on a uid of its own, or in the sandbox's own user namespace (where the
    harness shares the uid: one more); None where it would count all of this user's
    processes (isolation none, not root)."""
    if uid is not None:
        return limits.processes
    return limits.processes + 1 if iso.namespaces else None


def _spawn(
    job: dict, limits: SandboxSettings, iso: Isolation, workdir: str, run_id: str
) -> tuple[bytes, bytes, str]:
    r_chan, w_chan = os.pipe()
    r_filter = _filter_pipe()
    job["channel_fd"] = w_chan
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir}
    prefix = iso.argv(workdir, limits.disk_mb, r_filter)
    cmd = [*prefix, iso.python, "-I", "-S", "-B", "-c", HARNESS_SOURCE, MARKER + run_id]
    try:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            cwd=workdir, env=env, start_new_session=True, pass_fds=(w_chan, r_filter),
        )  # fmt: skip
    except BaseException:
        os.close(r_chan)
        raise
    finally:
        os.close(w_chan)
        os.close(r_filter)
    try:
        try:
            proc.stdin.write(json.dumps(job).encode())
        except BrokenPipeError:
            pass  # the harness died at start; its output says why
        finally:
            try:
                proc.stdin.close()
            except BrokenPipeError:
                pass
        deadline = time.monotonic() + limits.timeout_s + STARTUP_GRACE_S
        return _collect(proc, r_chan, deadline, limits.output_bytes)
    finally:
        _kill_group(proc)
        os.close(r_chan)
        _reap_stragglers(MARKER + run_id)


def _filter_pipe() -> int:
    """A pipe holding the seccomp program (a few hundred bytes: below any pipe buffer),
    its write end closed: bwrap reads it to EOF."""
    r, w = os.pipe()
    try:
        os.write(w, FILTER)
    finally:
        os.close(w)
    return r


def _collect(
    proc: subprocess.Popen, chan: int, deadline: float, out_cap: int
) -> tuple[bytes, bytes, str]:
    """Read both pipes until the channel closes, the output passes its cap or time is up."""
    out, frame = bytearray(), bytearray()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    sel.register(chan, selectors.EVENT_READ)
    try:
        while chan in sel.get_map() or proc.stdout in sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0 and chan in sel.get_map():
                return bytes(frame), bytes(out), "timeout: the sandbox did not finish in time"
            if left <= 0:
                break  # results are in; a straggler holds stdout open: it gets killed
            for key, _ in sel.select(left):
                fd = key.fileobj
                chunk = os.read(fd if isinstance(fd, int) else fd.fileno(), 65536)
                if not chunk:
                    sel.unregister(fd)
                    if fd == chan:  # the harness is done (or dead): stop waiting for stdout,
                        deadline = min(deadline, time.monotonic() + EXIT_GRACE_S)
                    continue  # which a straggler could hold open
                buf = frame if fd == chan else out
                buf += chunk
                if len(out) > out_cap:
                    return bytes(frame), bytes(out[:out_cap]), f"output over {out_cap} bytes"
                if len(frame) > CHANNEL_CAP:
                    return b"", bytes(out), "channel flooded"
    finally:
        sel.close()
    return bytes(frame), bytes(out), ""


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the session's process group; with --die-with-parent the harness (PID 1 of
    its namespace) dies with bwrap and the kernel kills everything in the namespace."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    proc.stdout.close()


def _reap_stragglers(marker: str, within_s: float = 10.0) -> None:
    """Return only once no process carries this run's marker. SIGKILL is asynchronous: on a
    loaded box the harness (PID 1 of its namespace) can still be alive for a while after
    bwrap is reaped, and grading must not return with a sandbox process running."""
    needle = marker.encode()
    end = time.monotonic() + within_s
    while True:
        alive = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                if needle in Path(f"/proc/{pid}/cmdline").read_bytes():
                    alive.append(int(pid))
            except OSError:
                continue  # gone meanwhile, or not ours to read
        if not alive:
            return
        if time.monotonic() > end:
            log.warning("sandbox processes %s survived SIGKILL for %.0f s", alive, within_s)
            return
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)


def _parse_frame(data: bytes, nonce: str, n: int) -> tuple[dict | None, str]:
    if not data:
        return None, "the sandbox sent no results (killed, or the harness failed)"
    try:
        frame = json.loads(data)
    except ValueError:
        return None, "the result channel carried something other than one frame"
    if not isinstance(frame, dict) or frame.get("nonce") != nonce:
        return None, "the result frame does not carry this run's nonce"
    cases = frame.get("cases")
    if not (isinstance(cases, list) and len(cases) == n):
        return None, "the result frame does not hold one result per case"
    return frame, ""
