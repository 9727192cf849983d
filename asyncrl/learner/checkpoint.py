"""Sharded checkpoints with exact resume, written so that a crash never loses the last one.

    PATH/
      state/                torch.distributed.checkpoint: model + optimizer, one file per
                            rank, global tensor shapes (reshardable: a checkpoint of N
                            ranks at tp T loads on M ranks at any tp)
      rng/rank{r}.safetensors  torch / CUDA / numpy / python RNG states of rank r
      learner.json          policy version, world size and tp, LR scheduler state
      driver_state.json     the driver's opaque state (queue accounting, task samplers)
      hf/                   (optional) an HF model directory of the weights
      manifest.json         size and CRC32 of every file above; written last

A run keeps its checkpoints as ``RUN/checkpoints/step-V`` (the newest ``keep``) and
``RUN/checkpoint``, a symlink to the newest. Every save goes aside, then switches
(asyncrl/storage/atomic.py):

    write PATH.tmp (every rank) ─▶ manifest (rank 0) ─▶ PATH→PATH.old ─▶ PATH.tmp→PATH
      ─▶ remove PATH.old ─▶ RUN/checkpoint re-pointed (symlink swap) ─▶ older steps pruned

Renames and the symlink swap are atomic, and nothing complete is removed before its
successor is complete and in place, so a crash at any moment leaves a complete
checkpoint: :func:`asyncrl.learner.layout.find_latest` picks the newest one whose manifest checks out
(``step-V.old`` counts: it is complete, and exists alone only inside the switch).
Loading checks the manifest first: a missing, truncated or altered file fails with its name.
Loading runs no code from the directory: JSON, safetensors and DCP's files through
learner/safe_dcp.py; anything else raises :class:`CheckpointError`. The manifest is a CRC,
not a signature (docs/reliability.md, "Trust").
A rank on another node than the driver's saves and loads through the driver's file sink
(asyncrl/storage): the files, the manifest and the switch end up in the driver's run dir.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.optim.lr_scheduler import LambdaLR

from asyncrl.learner.config import LearnerSettings, Normalisation
from asyncrl.learner.dist import barrier, broadcast_from_rank0, is_distributed
from asyncrl.learner.layout import (
    DRIVER,
    FORMAT,
    META,
    RNG_DIR,
    STATE_DIR,
    CheckpointError,
    read_json,
    read_meta,
    rng_file,
    verify,
)
from asyncrl.learner.lora import export_adapter
from asyncrl.learner.safe_dcp import SafeLoadPlanner, SafeReader, read_metadata, reason
from asyncrl.storage import atomic
from asyncrl.storage.remote import call, download, remote_sink, staging, upload
from asyncrl.utils.rng import load_rng, save_rng

if TYPE_CHECKING:
    from ray.actor import ActorHandle


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes one process; with one rank that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _fresh_tmp(tmp: Path, rank: int, sink: ActorHandle | None) -> Path:
    """Where this rank writes: ``tmp`` itself on the driver's node, else a staging folder
    of this node whose files go to the driver's ``tmp`` (asyncrl/storage/remote.py)."""
    here = tmp if sink is None else staging(f"save-rank{rank}") / tmp.name
    if sink is not None:
        (here / RNG_DIR).mkdir(parents=True)
    if rank == 0 and sink is not None:
        call(sink.reset_dir.remote(str(tmp), [RNG_DIR]))  # ranks on the driver's node
    elif rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / RNG_DIR).mkdir(parents=True)
    return here


def state_options(model: torch.nn.Module):
    """Frozen parameters (the base weights under ``learner.lora``) stay out of the state:
    they are ``model.path``'s, loaded again at start; a checkpoint holds what trains."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=True, strict=not frozen)


def without_frozen(model: torch.nn.Module, msd: dict[str, Any]) -> dict[str, Any]:
    """``msd`` less the entries that are frozen parameters under another name (a tied LM
    head: the embedding's tensor, which ``ignore_frozen_params`` does not see)."""
    frozen = {p.data_ptr() for p in model.parameters() if not p.requires_grad}
    if not frozen:
        return msd
    return {k: v for k, v in msd.items()
            if not (isinstance(v, torch.Tensor) and v.data_ptr() in frozen)}  # fmt: skip


def write_state(here: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
    """Collective: the shards of model and optimizer, then this rank's RNG states."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt, options=state_options(model))
    msd = without_frozen(model, msd)
    with _single_process_quiet():
        dcp.save(
            {"model": msd, "optim": osd},
            checkpoint_id=str(here / STATE_DIR),
            no_dist=not is_distributed(),
        )
    save_rng(rng_file(here, rank))


def save(
    path: str | Path,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: LambdaLR,
    meta: dict[str, Any],
    rank: int,
    driver_state: dict[str, Any] | None = None,
    extra: Callable[[Path], None] | None = None,
) -> str:
    """Collective: every rank calls it. ``meta`` goes to ``learner.json``; ``extra(tmp)``
    (rank 0) adds files before the manifest seals them (the HF export)."""
    root = Path(path)
    tmp = root.with_name(root.name + atomic.TMP)
    sink = remote_sink()
    here = _fresh_tmp(tmp, rank, sink)
    barrier()
    write_state(here, model, opt, rank)
    if sink is not None and rank != 0:
        upload(sink, here, tmp)
    barrier()
    if rank == 0:
        full = {"format": FORMAT, **meta, "scheduler": sched.state_dict()}
        (here / META).write_text(json.dumps(full, indent=1))
        (here / DRIVER).write_text(json.dumps(driver_state or {}))
        if extra is not None:
            extra(here)
        if sink is None:
            atomic.seal(tmp, root)
        else:  # the same manifest, fsync and switch, at the driver's side
            upload(sink, here, tmp)
            call(sink.seal_checkpoint.remote(str(tmp), str(root)))
    if sink is not None:
        shutil.rmtree(here.parent, ignore_errors=True)
    barrier()
    return str(root)


def _checked_by_rank0(root: Path, rank: int, sink: ActorHandle | None) -> None:
    """Collective: rank 0 checks every CRC (at the driver's side through a sink); every
    rank raises its error."""
    err = None
    if rank == 0 and sink is not None:
        err = call(sink.verify.remote(str(root)))
        err = err and f"checkpoint {err}"
    elif rank == 0:
        try:
            verify(root, full=True)
        except (CheckpointError, OSError, ValueError) as e:
            err = str(e)
    err = broadcast_from_rank0(err)
    if err:
        raise CheckpointError(err)


def read_state(root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Model and optimizer from ``root/state``, nothing in it run (learner/safe_dcp.py)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    state_dir = root / STATE_DIR
    options = state_options(model)
    msd, osd = get_state_dict(model, opt, options=options)
    msd = without_frozen(model, msd)
    state = {"model": msd, "optim": osd}
    try:
        read_metadata(state_dir)  # refused here with one line, before DCP's retries
        with _single_process_quiet():
            dcp.load(
                state,
                storage_reader=SafeReader(state_dir),
                planner=SafeLoadPlanner(),
                no_dist=not is_distributed(),
            )
    except (Exception, CheckpointException) as e:
        cause = _first_failure(e)
        why = f"{type(cause).__name__}: {reason(cause)}"
        raise CheckpointError(f"cannot load {state_dir}: {why}") from e
    set_state_dict(
        model,
        opt,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=options,
    )


def _first_failure(e: BaseException) -> BaseException:
    """DCP wraps a rank's error in a ``CheckpointException``; the error itself."""
    failures = getattr(e, "failures", None) or {}
    for wrapped in failures.values():
        return wrapped[0] if isinstance(wrapped, tuple) else wrapped
    return e


def load(
    path: str | Path,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: LambdaLR,
    rank: int,
    check: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Collective. Restores model, optimizer, scheduler and this rank's RNG; returns
    ``learner.json`` plus ``driver_state``. ``check(learner.json)`` runs before any state
    is read (a refusal names the setting instead of a missing tensor)."""
    root = Path(path)
    sink = remote_sink()  # on another node than the driver's: verify there, then fetch
    _checked_by_rank0(root, rank, sink)
    if sink is not None:  # the HF export is not needed to resume
        root = staging(f"load-rank{rank}") / root.name
        download(sink, path, root, skip=("hf",))
    meta = read_meta(root)
    if check is not None:
        check(meta)
    read_state(root, model, opt)
    sched.load_state_dict(meta["scheduler"])
    # The first resumed step's LR comes from the schedule as configured now, not from the
    # saved optimizer's last LR: a run resumed with a larger max_steps has a longer cosine.
    for g, base, factor in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True):
        g["lr"] = base * factor(sched.last_epoch)
    rng = rng_file(root, rank)
    if rng.is_file():  # absent when resuming on more ranks than were saved
        try:
            load_rng(rng)
        except Exception as e:  # noqa: BLE001 - safetensors' errors share no base class
            raise CheckpointError(f"checkpoint file {rng}: not an RNG state: {e}") from e
    meta["driver_state"] = read_json(root / DRIVER)
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


class Checkpointer:
    """A learner rank's checkpoints (held by :class:`~asyncrl.learner.learner.Learner`):
    its model, optimizer and LR scheduler to a sharded checkpoint and back; ``learner.json``
    also records the settings a resume must match or report (world size, normalisation,
    value head)."""

    def __init__(
        self,
        policy: torch.nn.Module,
        opt: torch.optim.Optimizer,
        sched: LambdaLR,
        model_path: str,
        settings: LearnerSettings,
        rank: int,
    ) -> None:
        self.policy, self.opt, self.sched = policy, opt, sched
        self.model_path, self.rank, self.value_head = model_path, rank, settings.value_head
        self.lora = settings.lora
        self.recorded = {
            "lora_rank": settings.lora.rank or 0,
            "world_size": settings.world_size,
            "tp": settings.tp,
            "normalisation": Normalisation(settings.normalisation).value,
            "value_head": settings.value_head,
        }

    def save(
        self,
        path: str,
        version: int,
        lr_scale: float,
        driver_state: dict | None = None,
        hf_weights: dict[str, torch.Tensor] | None = None,
    ) -> str:
        """Collective. ``hf_weights`` (rank 0's full weights): also ``PATH/hf``, an HF
        model directory, sealed by the checkpoint's manifest."""
        meta = {"version": version, **self.recorded, "lr_scale": lr_scale}
        extra = None
        lm, src = self.policy.lm, self.model_path
        if hf_weights is not None and self.rank == 0:

            def extra(tmp: Path) -> None:
                export_hf(tmp / "hf", lm, hf_weights, src)

        elif self.lora.on and self.rank == 0:

            def extra(tmp: Path) -> None:
                export_adapter(tmp / "adapter", lm, self.lora, src)

        return save(path, self.policy, self.opt, self.sched, meta, self.rank, driver_state, extra)

    def load(self, path: str) -> dict[str, Any]:
        """Collective. ``learner.json`` plus ``driver_state``; a checkpoint saved with
        another ``learner.value_head`` is refused."""

        def same_lora(meta: dict[str, Any]) -> None:
            if meta.get("lora_rank", 0) != self.recorded["lora_rank"]:
                raise CheckpointError(
                    f"{path}: saved with learner.lora.rank={meta.get('lora_rank', 0)}, "
                    f"this run has {self.recorded['lora_rank']}"
                )

        meta = load(path, self.policy, self.opt, self.sched, self.rank, same_lora)
        if meta.get("value_head", False) != self.value_head:
            raise CheckpointError(
                f"{path}: saved with learner.value_head={meta.get('value_head')}, "
                f"this run has {self.value_head}"
            )
        return meta
