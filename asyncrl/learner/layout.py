"""A checkpoint directory's layout and a run's checkpoints, without torch: the names of
the files (asyncrl/learner/checkpoint.py writes and loads them), their checks against
the manifest, and which step directory a resume starts from. The driver and the tools
read checkpoints through this module before anything imports torch."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from asyncrl.storage import atomic

FORMAT = 2  # learner.json's format: 2 keeps the RNG states as safetensors
MANIFEST = atomic.MANIFEST
META = "learner.json"
DRIVER = "driver_state.json"
STATE_DIR = "state"
RNG_DIR = "rng"
STEPS_DIR = "checkpoints"  # RUN/checkpoints/step-V
LATEST = "checkpoint"  # RUN/checkpoint: symlink to the newest step (a directory in old runs)
_STEP = re.compile(r"^step-(\d+)(\.old)?$")


class CheckpointError(RuntimeError):
    pass


def rng_file(root: Path, rank: int) -> Path:
    return root / RNG_DIR / f"rank{rank}.safetensors"


def read_json(path: Path) -> Any:
    """A checkpoint's JSON file, or :class:`CheckpointError` naming it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {path} is not readable JSON: {e}") from e


def read_meta(root: Path) -> dict[str, Any]:
    """``learner.json``, checked to be this format's."""
    meta = read_json(root / META)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(
            f"checkpoint file {root / META}: format {got}, this asyncrl reads {FORMAT}"
        )
    return meta


def verify(path: str | Path, full: bool = True) -> dict[str, Any]:
    """Check every file against the manifest (sizes; CRCs too when ``full``) and return
    ``learner.json``. Raises :class:`CheckpointError` naming the first bad file."""
    root = Path(path)
    try:
        atomic.check_manifest(root, full)
    except atomic.ManifestError as e:
        raise CheckpointError(f"checkpoint {e}") from e
    return read_meta(root)


def step_dir(run_dir: str | Path, version: int) -> Path:
    return Path(run_dir) / STEPS_DIR / f"step-{version}"


def publish(run_dir: str | Path, version: int, keep: int) -> None:
    """After ``step-<version>`` is saved: point ``RUN/checkpoint`` at it (atomic symlink
    swap) and remove all but the newest ``keep`` steps (0: keep every one)."""
    run = Path(run_dir)
    latest, target = run / LATEST, Path(STEPS_DIR) / f"step-{version}"
    if latest.is_dir() and not latest.is_symlink():  # a run written before step dirs
        shutil.rmtree(latest)
    atomic.point_symlink(latest, target)  # relative: the run dir can move
    if keep <= 0:
        return
    steps = sorted(_steps(run), key=lambda p: (_version_of(p), not p.name.endswith(".old")))
    complete = [p for p in steps if _is_complete(p)]
    survivors = set(complete[-keep:]) | {run / target}
    for p in steps:
        if p not in survivors and _version_of(p) < version:
            shutil.rmtree(p, ignore_errors=True)


def _steps(run: Path) -> list[Path]:
    d = run / STEPS_DIR
    return [p for p in d.iterdir() if p.is_dir() and _STEP.match(p.name)] if d.is_dir() else []


def _version_of(p: Path) -> int:
    m = _STEP.match(p.name)
    return int(m.group(1)) if m else -1


def _is_complete(p: Path) -> bool:
    try:
        verify(p, full=False)
        return True
    except (CheckpointError, OSError, ValueError):
        return False


def find_latest(path: str | Path) -> Path:
    """The checkpoint to resume from: ``path`` itself when it is a checkpoint directory
    (checked by :func:`verify`), else the newest complete one of the run directory
    ``path`` (``checkpoints/step-V``, then a ``checkpoint`` directory)."""
    p = Path(path)
    if (p / MANIFEST).is_file() or not ((p / STEPS_DIR).is_dir() or (p / LATEST).is_dir()):
        return p  # a checkpoint directory, or not a run directory: verify() says which
    found = [(v, s) for s in _steps(p) if _is_complete(s) for v in [_version_of(s)]]
    legacy = p / LATEST
    if legacy.is_dir() and not legacy.is_symlink() and _is_complete(legacy):
        found.append((int(read_meta(legacy).get("version", 0)), legacy))
    if not found:
        raise CheckpointError(
            f"{p} holds no complete checkpoint (neither a checkpoint directory nor a run "
            f"directory with {STEPS_DIR}/step-V)"
        )
    return max(found, key=lambda vs: (vs[0], not vs[1].name.endswith(".old")))[1]
