"""Run outputs: TensorBoard scalars, a Parquet trajectory log, a live progress line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from asyncrl.trajectory import Trajectory

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
        ("response_ids", pa.list_(pa.int32())),
        ("behaviour_logprobs", pa.list_(pa.float32())),
        ("versions", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.bool_())),  # False: observation/tool tokens, not trained
        ("t_start", pa.float64()),
        ("t_end", pa.float64()),
    ]
)


class TrajectoryLog:
    """Appends one row group per learner step; readable with ``pyarrow.parquet``."""

    def __init__(self, path: Path):
        self.path = path
        self._w = pq.ParquetWriter(str(path), _SCHEMA)

    def write(self, step: int, trajs: list[Trajectory], learner_version: int) -> None:
        if not trajs:
            return
        cols: dict[str, list[Any]] = {f.name: [] for f in _SCHEMA}
        for t in trajs:
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
                "response_ids": t.response_ids.tolist(),
                "behaviour_logprobs": t.behaviour_logprobs.tolist(),
                "versions": t.versions.tolist(),
                "loss_mask": t.loss_mask.tolist(),
                "t_start": t.t_start,
                "t_end": t.t_end,
            }
            for k, v in row.items():
                cols[k].append(v)
        self._w.write_table(pa.table(cols, schema=_SCHEMA))

    def close(self) -> None:
        self._w.close()


class Scalars:
    """TensorBoard writer that also keeps the last value of every tag."""

    def __init__(self, logdir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._w = SummaryWriter(str(logdir))
        self.last: dict[str, float] = {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            if isinstance(v, int | float):
                self._w.add_scalar(k, v, step)
                self.last[k] = float(v)

    def text(self, tag: str, markdown: str, step: int = 0) -> None:
        """A TensorBoard text tab (Markdown), e.g. the run's fingerprint."""
        self._w.add_text(tag, markdown, step)

    def histogram(self, tag: str, values, step: int) -> None:
        if len(values):
            self._w.add_histogram(tag, values, step)

    def close(self) -> None:
        self._w.flush()
        self._w.close()
