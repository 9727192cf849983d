"""Run outputs: TensorBoard scalars, a crash-proof Parquet trajectory log, a live line.

The trajectory log is a folder of closed Parquet part files, ``trajectories/part-NNNNN
.parquet``, one per ``log.part_every`` learner steps. A part is written whole to a
temporary name and renamed, so a part that exists is complete and readable even when
the driver (and with it the learner) is SIGKILLed: a crash loses at most the steps
since the last part. :func:`read_trajectories` reads every part as one table (and the
single ``trajectories.parquet`` of runs made before the parts). A learner rank on
another node than the driver's writes each part to a staging folder of its node and
sends it to the driver's run directory through the file sink (asyncrl/storage).

Images a trajectory's prompt shows (``Trajectory.images``) are written once each, as
``trajectories/images/<key>.png`` (the key is a hash of the PNG bytes: a group's
samples, and any prompt showing the same image, share one file); the ``images``
column names them, relative to the log folder (empty for a text prompt). An env's
picture after each turn (``Trajectory.frames``, a browser page's screenshot) is written
the same way; the ``frames`` column names them in turn order ("" for a turn without one).
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from asyncrl.config import Settings, setting
from asyncrl.storage.remote import call, remote_sink, staging, upload_file
from asyncrl.storage.sink import allow_run_dir
from asyncrl.trajectory import Image, Trajectory

log = logging.getLogger(__name__)

LOG_DIR = "trajectories"  # inside the run directory
IMAGE_DIR = "images"  # inside LOG_DIR: one PNG per distinct image
LEGACY_FILE = "trajectories.parquet"  # runs before the part files
REPLAY_KEYS = ("loss/total", "learner/grad_norm")  # per step in batches.jsonl

_SCHEMA = pa.schema(
    [
        ("step", pa.int32()),
        ("traj_id", pa.string()),
        ("group_id", pa.string()),
        ("prompt", pa.string()),
        ("response", pa.string()),
        ("reward", pa.float32()),
        ("reward_breakdown", pa.string()),
        ("error", pa.string()),
        ("finish_reason", pa.string()),
        ("min_version", pa.int32()),
        ("max_version", pa.int32()),
        ("staleness", pa.int32()),
        ("prompt_tokens", pa.int32()),
        ("response_tokens", pa.int32()),
        ("prompt_ids", pa.list_(pa.int32())),  # with the rest: the learner's exact input (replay)
        ("response_ids", pa.list_(pa.int32())),
        ("behaviour_logprobs", pa.list_(pa.float32())),
        ("versions", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.bool_())),  # False: observation/tool tokens, not trained
        # What the loss used, per response token (null where the learner recorded none):
        # the learner's log-probs, the advantage and the IS weight (the loss's own
        # ``weights()`` where it has one, else the ratio exp(learner - behaviour)).
        ("learner_logprobs", pa.list_(pa.float32())),
        ("advantages", pa.list_(pa.float32())),
        ("is_weights", pa.list_(pa.float32())),
        ("t_start", pa.float64()),
        ("t_end", pa.float64()),
        ("images", pa.list_(pa.string())),  # images/<key>.png beside the parts, prompt order
        ("frames", pa.list_(pa.string())),  # images/<key>.png after each turn ("": none)
        # a MoE engine's routed experts (Trajectory.routed_experts): the uint8 array's
        # bytes and its shape [positions, moe layers, top_k]; null where none were recorded
        ("routed_experts", pa.binary()),
        ("routed_experts_shape", pa.list_(pa.int32())),
    ]
)


@dataclass
class LogSettings(Settings):
    """``log`` in config: the trajectory log's parts and its size for long runs
    (conf/log/default.yaml holds every value)."""

    KEY = "log"

    part_every: int = setting(">= 1")  # learner steps per part file (what a crash can lose)
    sample_frac: float = setting("(0, 1]")  # fraction of trajectories logged (by id hash)
    max_rows: int | None = setting(">= 0")  # stop logging after this many rows (null: no cap)
    # Per-step trajectory ids, in the order the learner trained on them, with the step's
    # loss and grad norm (``batches.jsonl``, what ``asyncrl-replay`` feeds the learner
    # again and compares with); small, so never sampled.
    batch_ids: bool = setting()
    # Keep every periodic checkpoint (learner.checkpoint_every) as checkpoints/step-V, not
    # only the latest: what ``asyncrl-replay --from-step V`` starts from.
    keep_checkpoints: bool = setting()

    def spec(self, out_dir: Path) -> dict[str, Any]:
        """What the learner's rank 0 needs to write the log (plain data, for Ray). On a
        cluster the driver's file sink may now write under ``out_dir`` (asyncrl/storage)."""
        allow_run_dir(out_dir)
        return {"dir": str(out_dir / LOG_DIR), **self.__dict__}


def _sampled(traj_id: str, frac: float) -> bool:
    """Deterministic per trajectory id, so a rerun logs the same rows."""
    return frac >= 1.0 or zlib.crc32(traj_id.encode()) / 2**32 < frac


class TrajectoryLog:
    """Buffers the rows of ``part_every`` steps, then writes them as one closed part."""

    def __init__(self, spec: str | dict[str, Any]):
        if isinstance(spec, str):  # a bare folder: the default settings
            spec = {"dir": spec}
        self.dir = Path(spec["dir"])
        self._sink = remote_sink()  # None on the driver's node: parts written in place
        if self._sink is None:
            self.dir.mkdir(parents=True, exist_ok=True)
        known = {k: v for k, v in spec.items() if k in LogSettings.__dataclass_fields__}
        whole = len(known) == len(LogSettings.__dataclass_fields__)  # a run's spec() is whole
        self.settings = LogSettings(**known) if whole else LogSettings.defaults(**known)
        self.settings.check()
        self._rows: dict[str, list[Any]] = {f.name: [] for f in _SCHEMA}
        self._steps = 0
        if self._sink is None:  # a resumed run appends
            self._part = len(list(self.dir.glob("part-*.parquet")))
        else:
            self._part = call(self._sink.count.remote(str(self.dir), "part-*.parquet"))
            self._stage = staging("trajectories")
        self.rows_written = 0
        self.rows_skipped = 0
        self._images: set[str] = set()  # keys of the image files written

    def write(
        self,
        step: int,
        trajs: list[Trajectory],
        learner_version: int,
        tokens: list[dict[str, Any] | None] | None = None,
        metrics: dict[str, float] | None = None,
    ) -> None:
        """One learner step's rows; ``tokens[i]``: trajectory i's per-token
        ``learner_logprobs`` / ``advantages`` / ``is_weights`` (numpy), or None;
        ``metrics``: the step's (``batches.jsonl`` keeps the loss and grad norm)."""
        s = self.settings
        if s.batch_ids and trajs:
            self._write_batch_ids(step, trajs, metrics)
        for i, t in enumerate(trajs):
            if not _sampled(t.traj_id, s.sample_frac):
                continue
            if s.max_rows is not None and self.rows_written >= s.max_rows:
                if not self.rows_skipped:
                    log.warning("log.max_rows=%d reached: no more trajectory rows", s.max_rows)
                self.rows_skipped += 1
                continue
            tok = (tokens[i] if tokens else None) or {}
            rec = t.routed_experts
            row = {
                "step": step,
                "traj_id": t.traj_id,
                "group_id": t.group_id,
                "prompt": t.prompt_text,
                "response": t.response_text,
                "reward": t.reward,
                "reward_breakdown": json.dumps(t.reward_breakdown),
                "error": t.error,
                "finish_reason": t.finish_reason,
                "min_version": t.min_version,
                "max_version": t.max_version,
                "staleness": learner_version - t.min_version,
                "prompt_tokens": len(t.prompt_ids),
                "response_tokens": len(t.response_ids),
                "prompt_ids": t.prompt_ids.tolist(),
                "response_ids": t.response_ids.tolist(),
                "behaviour_logprobs": t.behaviour_logprobs.tolist(),
                "versions": t.versions.tolist(),
                "loss_mask": t.loss_mask.tolist(),
                "learner_logprobs": _list(tok.get("learner_logprobs")),
                "advantages": _list(tok.get("advantages")),
                "is_weights": _list(tok.get("is_weights")),
                "t_start": t.t_start,
                "t_end": t.t_end,
                "images": [self._image(im) for im in t.images] if t.images else [],
                "frames": [self._image(im) if im else "" for im in t.frames],
                "routed_experts": None if rec is None else rec.tobytes(),
                "routed_experts_shape": None if rec is None else list(rec.shape),
            }
            for k, v in row.items():
                self._rows[k].append(v)
            self.rows_written += 1
        self._steps += 1
        if self._steps >= s.part_every:
            self.flush()

    def _image(self, im: Image) -> str:
        """The image's file name in the log folder, written the first time it is seen."""
        name = f"{IMAGE_DIR}/{im.key}.png"
        if im.key in self._images:
            return name
        self._images.add(im.key)
        if self._sink is not None:
            local = self._stage / f"{im.key}.png"
            local.write_bytes(im.png)
            upload_file(self._sink, local, str(self.dir / name))
            local.unlink()
        else:
            (self.dir / IMAGE_DIR).mkdir(exist_ok=True)
            tmp = self.dir / f"{name}.tmp"
            tmp.write_bytes(im.png)
            os.replace(tmp, self.dir / name)  # whole or absent, as the parts
        return name

    def _write_batch_ids(
        self, step: int, trajs: list[Trajectory], metrics: dict[str, float] | None
    ) -> None:
        """One ``batches.jsonl`` line: the step's trajectory ids, loss and grad norm."""
        rec = {"step": step, "traj_ids": [t.traj_id for t in trajs]}
        rec.update({k: float(metrics[k]) for k in REPLAY_KEYS if k in (metrics or {})})
        line = json.dumps(rec) + "\n"  # floats as repr: exact doubles
        if self._sink is not None:
            call(self._sink.append.remote(str(self.dir / "batches.jsonl"), line.encode()))
        else:
            with open(self.dir / "batches.jsonl", "a") as f:  # one line: survives a kill
                f.write(line)

    def flush(self) -> None:
        """Write the buffered rows as the next part (closed, renamed into place)."""
        self._steps = 0
        if not self._rows["step"]:
            return
        path = self.dir / f"part-{self._part:05d}.parquet"
        local = path if self._sink is None else self._stage / path.name
        tmp = local.with_name(path.name + ".tmp")
        pq.write_table(pa.table(self._rows, schema=_SCHEMA), str(tmp))
        os.replace(tmp, local)  # atomic: readers never see half a part
        if self._sink is not None:  # the sink writes aside and renames too
            upload_file(self._sink, local, str(path))
            local.unlink()
        self._part += 1
        self._rows = {f.name: [] for f in _SCHEMA}

    def close(self) -> None:
        self.flush()
        if self._sink is not None:  # every part is at the driver's now
            import shutil

            shutil.rmtree(self._stage, ignore_errors=True)


def _list(a: Any) -> list[float] | None:
    return None if a is None else [float(x) for x in a]


def trajectory_parts(run_dir: str | Path) -> list[Path]:
    """The finished part files of a run (its folder, or the run directory), in order."""
    p = Path(run_dir)
    folder = p / LOG_DIR if (p / LOG_DIR).is_dir() else p
    return sorted(folder.glob("part-*.parquet"))


def read_trajectories(run_dir: str | Path, columns: list[str] | None = None) -> pa.Table:
    """Every logged trajectory of a run as one table (the part files in order; a run
    made before the parts: its single ``trajectories.parquet``)."""
    p = Path(run_dir)
    parts = trajectory_parts(p)
    if not parts and (p / LEGACY_FILE).is_file():
        return pq.read_table(p / LEGACY_FILE, columns=columns)
    if not parts:
        raise FileNotFoundError(f"{p}: no trajectory log ({LOG_DIR}/part-*.parquet)")
    tables = [pq.read_table(f, columns=columns) for f in parts]
    return pa.concat_tables(tables, promote_options="default")


def read_batches(run_dir: str | Path, full: bool = False) -> dict[int, Any]:
    """``step -> trajectory ids`` in the order the learner trained on them (``full``:
    the whole record, with the step's ``loss/total`` and ``learner/grad_norm``)."""
    p = Path(run_dir)
    f = (p / LOG_DIR if (p / LOG_DIR).is_dir() else p) / "batches.jsonl"
    out: dict[int, list[str]] = {}
    for line in f.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # the last line of a killed run may be cut short
            continue
        out[int(rec["step"])] = rec if full else rec["traj_ids"]
    return out


class Scalars:
    """TensorBoard writer that also keeps the last value of every tag."""

    def __init__(self, logdir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(str(logdir))
        self.last: dict[str, float] = {}

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Numbers are scalars; a list or array of numbers is a histogram (``staleness/hist``)."""
        for k, v in metrics.items():
            if isinstance(v, int | float):
                self._w.add_scalar(k, v, step)
                self.last[k] = float(v)
            elif isinstance(v, list | tuple) or hasattr(v, "__array__"):
                self.histogram(k, np.asarray(v, dtype=np.float64), step)

    def text(self, tag: str, markdown: str, step: int = 0) -> None:
        """A TensorBoard text tab (Markdown), e.g. the run's fingerprint."""
        self._w.add_text(tag, markdown, step)

    def histogram(self, tag: str, values, step: int) -> None:
        if len(values):
            self._w.add_histogram(tag, values, step)

    def close(self) -> None:
        self._w.flush()
        self._w.close()
