"""``sandbox.*`` in config: how many programs run at once and the limits each one gets.
``SandboxSettings.from_config`` checks every value at start-up and names the key."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from asyncrl.config import Settings, setting

MIN_MEMORY_MB = 64  # the harness's own mappings (interpreter, json, ctypes) are ~30 MB
MAX_WORKERS = 256  # one sandbox uid per worker slot; see isolation.sandbox_uid
# Upper bounds: a larger value could not be set, and every case would fail its set-up.
MAX_TIMEOUT_S = 3600  # one execution's wall clock
MAX_MB = 1 << 20  # 1 TiB: memory, file and tmpfs sizes (bytes stay far inside an rlim_t)
# A case cannot raise RLIMIT_NOFILE above the grader's own hard limit (20000 measured
# here: 20001 failed every case); 4096 is the smallest hard limit Linux hosts ship.
MAX_OPEN_FILES = 4096
MAX_PROCESSES = 1 << 15  # the kernel's default pid_max
MAX_BYTES = 1 << 30  # output and result caps


class Isolation(enum.StrEnum):
    """``sandbox.isolation`` (asyncrl/sandbox/isolation.py)."""

    BWRAP = "bwrap"  # bubblewrap namespaces + the seccomp filter
    NONE = "none"  # unconfined: trusted code only


@dataclass
class SandboxSettings(Settings):
    """Limits of one execution (one ``grade_python`` call: all of its cases); conf/sandbox/
    default.yaml holds every value. Too small a value is refused at start-up (the harness
    would fail every case) as is too large a one (the limit could not be set)."""

    KEY = "sandbox"

    workers: int = setting(f"[1, {MAX_WORKERS}]")  # executions at once; one process tree each
    timeout_s: float = setting(f"(0, {MAX_TIMEOUT_S}]")  # wall clock for all cases of one run
    # address space of each case's process (RLIMIT_AS); a forked Python needs MIN_MEMORY_MB
    memory_mb: int = setting(f"[{MIN_MEMORY_MB}, {MAX_MB}]")
    file_mb: int = setting(f"[1, {MAX_MB}]")  # largest file a case may write (RLIMIT_FSIZE)
    disk_mb: int = setting(f"[1, {MAX_MB}]")  # size of the private tmpfs work dir (namespaces)
    open_files: int = setting(f"[1, {MAX_OPEN_FILES}]")  # RLIMIT_NOFILE
    processes: int = setting(f"[1, {MAX_PROCESSES}]")  # processes + threads of the uid (NPROC)
    output_bytes: int = setting(f"[1024, {MAX_BYTES}]")  # stdout+stderr of an execution
    result_bytes: int = setting(f"[1024, {MAX_BYTES}]")  # one case's serialized return value
    # bwrap: namespaces + seccomp, refused where unavailable | none: unconfined (warns)
    isolation: Isolation = setting()
    python: str = setting()  # interpreter the programs run under; "" = the grader's own
