"""Learner metrics: combining a loss's per-micro-batch metrics across micro-batches and
ranks, and the ``reward/*`` / ``staleness/*`` of the trajectories a step trained on.

How a loss metric combines, by name:

* ``loss/*``  : a sum (losses are already normalised over the global batch);
* ``*_max`` / ``*_min``: the max / min;
* anything else: a mean weighted by the micro-batch's share of the global batch's
  trained tokens, over the micro-batches that reported it (so a token-level mean is
  the global batch's, whatever the micro-batching or world size).
"""

from __future__ import annotations

from typing import Any

SUM, MAX, MIN, MEAN = "sum", "max", "min", "mean"


def kind_of(key: str) -> str:
    if key.startswith("loss/"):
        return SUM
    if key.endswith("_max"):
        return MAX
    if key.endswith("_min"):
        return MIN
    return MEAN


class MetricSums:
    """``key -> [kind, value, weight]``; plain data, so it pickles across ranks."""

    def __init__(self) -> None:
        self.acc: dict[str, list[Any]] = {}

    def add(self, metrics: dict[str, float], share: float) -> None:
        for k, v in metrics.items():
            self._fold(k, kind_of(k), float(v), share)

    def _fold(self, k: str, kind: str, v: float, w: float) -> None:
        if k not in self.acc:
            self.acc[k] = [kind, v * w if kind == MEAN else v, w]
            return
        e = self.acc[k]
        if kind == MEAN:
            e[1] += v * w
        elif kind == SUM:
            e[1] += v
        else:
            e[1] = max(e[1], v) if kind == MAX else min(e[1], v)
        e[2] += w

    @staticmethod
    def merge(parts: list[MetricSums]) -> dict[str, float]:
        total = MetricSums()
        for p in parts:
            for k, (kind, v, w) in p.acc.items():
                if k not in total.acc:
                    total.acc[k] = [kind, v, w]
                    continue
                e = total.acc[k]
                if kind in (MEAN, SUM):
                    e[1] += v
                else:
                    e[1] = max(e[1], v) if kind == MAX else min(e[1], v)
                e[2] += w
        return {
            k: (v / w if w > 0 else 0.0) if kind == MEAN else v
            for k, (kind, v, w) in total.acc.items()
        }


def trajectory_metrics(trajs: list, learner_version: int) -> dict[str, float]:
    """``reward/*`` and ``staleness/*`` of the trajectories one step trained on."""
    import numpy as np

    rewards = np.array([t.reward for t in trajs], dtype=np.float64)
    stale = np.array([learner_version - t.min_version for t in trajs], dtype=np.int64)
    out = {
        "reward/mean": float(rewards.mean()),
        "reward/sum": float(rewards.sum()),
        "reward/count": float(len(rewards)),
        "reward/errors": float(sum(bool(t.error) for t in trajs)),
        "staleness/mean": float(stale.mean()),
        "staleness/max": float(stale.max()),
        "tokens/trained": float(sum(len(t.response_ids) for t in trajs)),
        "tokens/trained_with_prompt": float(sum(t.num_tokens for t in trajs)),
    }
    keys = {k for t in trajs for k in t.reward_breakdown}
    for k in sorted(keys):
        out[f"reward/{k}"] = float(np.mean([t.reward_breakdown.get(k, 0.0) for t in trajs]))
    return out
