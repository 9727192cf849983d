"""``sandbox.*`` in config: how many programs run at once and the limits each one gets.
``SandboxSettings.from_config`` checks every value at start-up and names the key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncrl.config import ConfigError, settings_from


@dataclass
class SandboxSettings:
    """Limits of one execution (one ``grade_python`` call: all of its cases)."""

    workers: int = 2  # executions at once; each is one sandboxed process tree
    timeout_s: float = 5.0  # wall clock for all cases of one execution
    memory_mb: int = 512  # address space of each case's process (RLIMIT_AS)
    file_mb: int = 16  # largest file a case may write (RLIMIT_FSIZE)
    disk_mb: int = 64  # size of the private tmpfs work dir (with namespaces)
    open_files: int = 64  # RLIMIT_NOFILE
    processes: int = 32  # processes + threads of the sandbox uid (RLIMIT_NPROC)
    output_bytes: int = 65536  # stdout+stderr of the whole execution; more kills it
    result_bytes: int = 1 << 20  # one case's serialized return value; more fails the case
    isolation: str = "bwrap"  # bwrap (namespaces + seccomp; refused where unavailable) | none
    python: str = ""  # interpreter the programs run under; "" = the grader's own

    @classmethod
    def from_config(cls, node: Any) -> SandboxSettings:
        return settings_from(cls, node, "sandbox")

    def check(self) -> None:
        for key in ("workers", "memory_mb", "file_mb", "disk_mb", "open_files", "processes"):
            if getattr(self, key) < 1:
                raise ConfigError(f"sandbox.{key}={getattr(self, key)}: must be >= 1")
        if self.timeout_s <= 0:
            raise ConfigError(f"sandbox.timeout_s={self.timeout_s}: must be > 0")
        if self.memory_mb < MIN_MEMORY_MB:
            raise ConfigError(
                f"sandbox.memory_mb={self.memory_mb}: must be >= {MIN_MEMORY_MB} "
                "(a forked Python needs that much address space to start a case)"
            )
        if self.workers > MAX_WORKERS:
            raise ConfigError(f"sandbox.workers={self.workers}: must be <= {MAX_WORKERS}")
        for key in ("output_bytes", "result_bytes"):
            if getattr(self, key) < 1024:
                raise ConfigError(f"sandbox.{key}={getattr(self, key)}: must be >= 1024")
        for key, top in MAXIMA.items():
            if not getattr(self, key) <= top:  # NaN fails this too
                raise ConfigError(f"sandbox.{key}={getattr(self, key)}: must be <= {top}")
        if self.isolation not in ISOLATIONS:
            raise ConfigError(f"sandbox.isolation={self.isolation!r}: one of {ISOLATIONS}")


MIN_MEMORY_MB = 64  # the harness's own mappings (interpreter, json, ctypes) are ~30 MB
MAX_WORKERS = 256  # one sandbox uid per worker slot; see isolation.UidSlots
ISOLATIONS = ("bwrap", "none")
# beyond these a limit cannot be set (RLIMIT overflow, a hard limit) or is no limit at all
MAXIMA = {"timeout_s": 3600.0, "memory_mb": 1 << 20, "file_mb": 1 << 20, "disk_mb": 1 << 20,
          "open_files": 1 << 20, "processes": 1 << 16, "output_bytes": 1 << 30,
          "result_bytes": 1 << 22}  # fmt: skip
