"""What this host's CPU computes natively, read from /proc/cpuinfo (Linux).

bf16 matrix products run natively only on CPUs with AVX512-BF16 or AMX; elsewhere
torch's CPU kernels convert and fall back: a 256 x 512 x 2048 product with its backward
under ``torch.autocast("cpu", dtype=torch.bfloat16)`` took 0.99 s against fp32's
0.010 s on an AVX2 AMD EPYC (2026-12-07; docs/speed.md).
"""

from __future__ import annotations

from pathlib import Path

NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str] | None:
    """The first processor's flags, or None where /proc/cpuinfo cannot be read."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return None


def native_bf16(flags: set[str] | None = None) -> bool:
    """Whether bf16 matrix products run natively here (True where the flags are unknown:
    nothing is claimed)."""
    flags = cpu_flags() if flags is None else flags
    return flags is None or bool(flags & NATIVE_BF16_FLAGS)


def slow_bf16_warning(keys: list[str], flags: set[str] | None = None) -> str | None:
    """One line naming the settings in ``keys`` that compute in bf16 on this CPU, when it
    has no native bf16 (None otherwise, or when ``keys`` is empty)."""
    if not keys or native_bf16(flags):
        return None
    return (
        f"{', '.join(keys)}: bf16 on this CPU (no AVX512-BF16 or AMX) runs about 100x slower "
        "than fp32 (a matrix product and its backward, docs/speed.md); set them to fp32 "
        "(false / null / float32) unless this is deliberate"
    )
