"""Sharded checkpoints with exact resume, written so that a crash never loses the last one.

    PATH/
      state/              torch.distributed.checkpoint: model + optimizer, one file per
                          rank (reshardable: a checkpoint of N ranks loads on M)
      rng/rank{r}.pt      torch / CUDA / numpy / python RNG states of rank r
      learner.json        policy version, world size, LR scheduler state
      driver_state.json   the driver's opaque state (queue accounting, task samplers)
      hf/                 (optional) an HF model directory of the weights
      manifest.json       size and CRC32 of every file above; written last

A run keeps its checkpoints as ``RUN/checkpoints/step-V`` (the newest ``keep``) and
``RUN/checkpoint``, a symlink to the newest. Every save goes aside, then switches:

    write PATH.tmp (every rank) ─▶ manifest (rank 0) ─▶ PATH→PATH.old ─▶ PATH.tmp→PATH
      ─▶ remove PATH.old ─▶ RUN/checkpoint re-pointed (symlink swap) ─▶ older steps pruned

Renames and the symlink swap are atomic, and nothing complete is removed before its
successor is complete and in place, so a crash at any moment leaves a complete
checkpoint: :func:`find_latest` picks the newest one whose manifest checks out
(``step-V.old`` counts: it is complete, and exists alone only inside the switch).
Loading checks the manifest first: a missing, truncated or altered file fails with its name.
A rank on another node than the driver's saves and loads through the driver's file sink
(asyncrl/cluster): the files, the manifest and the switch end up in the driver's run dir.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from asyncrl.cluster.remote import call, download, remote_sink, staging, upload
from asyncrl.learner.dist import barrier, broadcast_from_rank0, is_distributed
from asyncrl.utils.rng import rng_state, set_rng_state  # noqa: F401 (here before)

FORMAT = 1
MANIFEST = "manifest.json"
META = "learner.json"
DRIVER = "driver_state.json"
STATE_DIR = "state"
CRC_CHUNK = 1 << 22  # bytes read at a time when checksumming
STEPS_DIR = "checkpoints"  # RUN/checkpoints/step-V
LATEST = "checkpoint"  # RUN/checkpoint: symlink to the newest step (a directory in old runs)
_STEP = re.compile(r"^step-(\d+)(\.old)?$")


class CheckpointError(RuntimeError):
    pass


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes one process; with one rank that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _crc(path: Path) -> int:
    c = 0
    with open(path, "rb") as f:
        while chunk := f.read(CRC_CHUNK):
            c = zlib.crc32(chunk, c)
    return c


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(root: Path) -> None:
    entries = {
        str(p.relative_to(root)): {"bytes": p.stat().st_size, "crc32": _crc(p)}
        for p in _files(root)
    }
    (root / MANIFEST).write_text(json.dumps({"format": FORMAT, "files": entries}, indent=1))


def verify(path: str | Path, full: bool = True) -> dict[str, Any]:
    """Check every file against the manifest (sizes; CRCs too when ``full``) and return
    ``learner.json``. Raises :class:`CheckpointError` naming the first bad file."""
    root = Path(path)
    man = root / MANIFEST
    if not man.is_file():
        raise CheckpointError(
            f"{man} is missing: {root} is not a complete asyncrl checkpoint "
            f"(interrupted save, or not a checkpoint directory)"
        )
    try:
        files = json.loads(man.read_text())["files"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint file {man} is corrupted: {e}") from e
    for rel, want in files.items():
        f = root / rel
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {f} is missing")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(
                f"checkpoint file {f} is corrupted: {size} bytes, the manifest says {want['bytes']}"
            )
        if full and _crc(f) != want["crc32"]:
            raise CheckpointError(f"checkpoint file {f} is corrupted: CRC32 mismatch")
    meta = json.loads((root / META).read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint file {root / META}: format {meta.get('format')}, expected {FORMAT}"
        )
    return meta


def save(
    path: str | Path,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: Any,
    meta: dict[str, Any],
    rank: int,
    driver_state: dict[str, Any] | None = None,
    extra: Callable[[Path], None] | None = None,
) -> str:
    """Collective: every rank calls it. ``meta`` goes to ``learner.json``; ``extra(tmp)``
    (rank 0) adds files before the manifest seals them (the HF export)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = Path(path)
    tmp = root.with_name(root.name + ".tmp")
    # A rank on another node than the driver's writes to a staging folder of its own
    # node and sends the files to the driver's tmp (asyncrl/cluster): the switch still
    # happens there, after every file is in. On the driver's node: in place, as always.
    sink = remote_sink()
    here = tmp if sink is None else staging(f"save-rank{rank}") / tmp.name
    if sink is not None:
        (here / "rng").mkdir(parents=True)
    if rank == 0 and sink is not None:
        call(sink.reset_dir.remote(str(tmp)))  # ranks on the driver's node write there
    elif rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    barrier()
    msd, osd = get_state_dict(model, opt)
    with _single_process_quiet():
        dcp.save(
            {"model": msd, "optim": osd},
            checkpoint_id=str(here / STATE_DIR),
            no_dist=not is_distributed(),
        )
    torch.save(rng_state(), here / "rng" / f"rank{rank}.pt")
    if sink is not None and rank != 0:
        upload(sink, here, tmp)
    barrier()
    _crash_point("shards written")
    if rank == 0:
        full = {"format": FORMAT, **meta, "scheduler": sched.state_dict()}
        (here / META).write_text(json.dumps(full, indent=1))
        (here / DRIVER).write_text(json.dumps(driver_state or {}))
        if extra is not None:
            extra(here)
        _crash_point("files written")
        if sink is None:
            write_manifest(tmp)
            _fsync_tree(tmp)
            _crash_point("manifest written")
            _switch(tmp, root)
        else:  # the same manifest, fsync and switch, at the driver's side
            upload(sink, here, tmp)
            call(sink.seal_checkpoint.remote(str(tmp), str(root)))
    if sink is not None:
        shutil.rmtree(here.parent, ignore_errors=True)
    barrier()
    return str(root)


def _crash_point(name: str) -> None:
    """A point between two steps of a save; tests make it raise to prove each is safe."""


def _fsync_tree(root: Path) -> None:
    """Contents on disk before the rename makes them the checkpoint (a power cut after
    the rename must not leave a renamed directory of empty files)."""
    for p in [*_files(root), root / MANIFEST]:
        with open(p, "rb") as f:
            os.fsync(f.fileno())


def _switch(tmp: Path, root: Path) -> None:
    """``tmp`` (complete) becomes ``root``; the old ``root`` is removed only after."""
    old = root.with_name(root.name + ".old")
    if old.exists() and not root.exists():  # a crash inside the last switch: restore first
        os.replace(old, root)
    shutil.rmtree(old, ignore_errors=True)  # root is complete, so this leftover is spare
    if root.exists():
        os.replace(root, old)
        _crash_point("old moved aside")
    os.replace(tmp, root)
    _crash_point("new in place")
    shutil.rmtree(old, ignore_errors=True)


def step_dir(run_dir: str | Path, version: int) -> Path:
    return Path(run_dir) / STEPS_DIR / f"step-{version}"


def publish(run_dir: str | Path, version: int, keep: int) -> None:
    """After ``step-<version>`` is saved: point ``RUN/checkpoint`` at it (atomic symlink
    swap) and remove all but the newest ``keep`` steps (0: keep every one)."""
    run = Path(run_dir)
    latest, target = run / LATEST, Path(STEPS_DIR) / f"step-{version}"
    if latest.is_dir() and not latest.is_symlink():  # a run written before step dirs
        shutil.rmtree(latest)
    link = run / (LATEST + ".link")
    link.unlink(missing_ok=True)
    link.symlink_to(target, target_is_directory=True)  # relative: the run dir can move
    os.replace(link, latest)
    _crash_point("latest switched")
    if keep <= 0:
        return
    steps = sorted(_steps(run), key=lambda p: (_version_of(p), not p.name.endswith(".old")))
    complete = [p for p in steps if _is_complete(p)]
    survivors = set(complete[-keep:]) | {run / target}
    for p in steps:
        if p not in survivors and _version_of(p) < version:
            shutil.rmtree(p, ignore_errors=True)
            _crash_point("pruned one")


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
    (as before; checked by :func:`verify`), else the newest complete one of the run
    directory ``path`` (``checkpoints/step-V``, then ``checkpoint`` of an older run)."""
    p = Path(path)
    if (p / MANIFEST).is_file() or not ((p / STEPS_DIR).is_dir() or (p / LATEST).is_dir()):
        return p  # a checkpoint directory, or not a run directory: verify() says which
    found = [(v, s) for s in _steps(p) if _is_complete(s) for v in [_version_of(s)]]
    legacy = p / LATEST
    if legacy.is_dir() and not legacy.is_symlink() and _is_complete(legacy):
        found.append((int(json.loads((legacy / META).read_text()).get("version", 0)), legacy))
    if not found:
        raise CheckpointError(
            f"{p} holds no complete checkpoint (neither a checkpoint directory nor a run "
            f"directory with {STEPS_DIR}/step-V)"
        )
    return max(found, key=lambda vs: (vs[0], not vs[1].name.endswith(".old")))[1]


def load(
    path: str | Path, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, rank: int
) -> dict[str, Any]:
    """Collective. Restores model, optimizer, scheduler and this rank's RNG; returns
    ``learner.json`` plus ``driver_state``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    root = Path(path)
    sink = remote_sink()  # on another node than the driver's: verify there, then fetch
    err = None
    if rank == 0 and sink is not None:
        err = call(sink.verify.remote(str(root)))
    elif rank == 0:
        try:
            verify(root, full=True)
        except (CheckpointError, OSError, ValueError) as e:
            err = str(e)
    err = broadcast_from_rank0(err)
    if err:
        raise CheckpointError(err)
    if sink is not None:  # the HF export is not needed to resume
        root = staging(f"load-rank{rank}") / root.name
        download(sink, path, root, skip=("hf",))
    meta = json.loads((root / META).read_text())
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(root / STATE_DIR), no_dist=not is_distributed())
    except Exception as e:
        raise CheckpointError(f"cannot load {root / STATE_DIR}: {type(e).__name__}: {e}") from e
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    sched.load_state_dict(meta["scheduler"])
    # The first resumed step's LR comes from the schedule as configured now, not from the
    # saved optimizer's last LR: a run resumed with a larger max_steps has a longer cosine.
    for g, base, factor in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True):
        g["lr"] = base * factor(sched.last_epoch)
    rng = root / "rng" / f"rank{rank}.pt"
    if rng.is_file():  # absent when resuming on more ranks than were saved
        set_rng_state(torch.load(rng, weights_only=False))
    meta["driver_state"] = json.loads((root / DRIVER).read_text())
    if sink is not None:
        shutil.rmtree(root.parent, ignore_errors=True)
    return meta


def export_hf(out: Path, lm: torch.nn.Module, sd: dict[str, torch.Tensor], src: str) -> None:
    """An HF model directory: our weights, the source's config-adjacent files (tokenizer)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if (
            f.is_file()
            and f.suffix not in (".safetensors", ".bin", ".pt")
            and "index" not in f.name
        ):
            shutil.copy2(f, out / f.name)
    lm.config.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))


# The module's functions under names the methods below do not shadow.
def _save(*a: Any, **k: Any) -> str:
    return save(*a, **k)


def _load(*a: Any, **k: Any) -> dict[str, Any]:
    return load(*a, **k)


def _export_hf(*a: Any) -> None:
    export_hf(*a)


class CheckpointMethods:
    """A learner rank's ``save`` / ``load`` (mixed into :class:`~asyncrl.learner.learner.
    Learner`, which provides the model, optimizer, scheduler and version)."""

    def save(self, path: str, driver_state: dict | None = None, export_hf: bool = True) -> str:
        """Sharded checkpoint (collective); with ``export_hf`` also ``PATH/hf``, an HF model
        directory of the current weights (what vLLM or ``model.path`` can load)."""
        meta = {
            "version": self.version,
            "world_size": self.world_size,
            "normalisation": self.normalisation.value,
            "value_head": self.value_head is not None,
            "lr_scale": self.lr_scale,
        }
        extra = None
        if export_hf:  # inside the checkpoint, sealed by its manifest
            sd = self.full_state_dict()
            if self.rank == 0:

                def extra(tmp: Path) -> None:
                    _export_hf(tmp / "hf", self.model, sd, self.model_path)

        return _save(path, self.policy, self.opt, self.sched, meta, self.rank, driver_state, extra)

    def load(self, path: str) -> dict[str, Any]:
        """Restore a checkpoint (collective). Returns ``{"version", "driver_state", ...}``."""
        meta = _load(path, self.policy, self.opt, self.sched, self.rank)
        if meta.get("value_head", False) != (self.value_head is not None):
            raise CheckpointError(
                f"{path}: saved with learner.value_head={meta.get('value_head')}, "
                f"this run has {self.value_head is not None}"
            )
        self.version = int(meta["version"])
        self.lr_scale = float(meta.get("lr_scale", 1.0))  # older checkpoints: no brake state
        return meta
