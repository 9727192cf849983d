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

import enum
from typing import Any


class Combine(enum.StrEnum):
    """How one metric's values from several micro-batches and ranks combine."""

    SUM = "sum"
    MAX = "max"
    MIN = "min"
    MEAN = "mean"  # weighted by each micro-batch's share of the batch's tokens

    def fold(self, acc: float, value: float) -> float:
        """``acc`` and the next (already weighted, for a mean) ``value``, folded."""
        if self is Combine.MAX:
            return max(acc, value)
        if self is Combine.MIN:
            return min(acc, value)
        return acc + value


def kind_of(key: str) -> Combine:
    if key.startswith("loss/"):
        return Combine.SUM
    if key.endswith("_max"):
        return Combine.MAX
    if key.endswith("_min"):
        return Combine.MIN
    return Combine.MEAN


class MetricSums:
    """``key -> [how, value, weight]``; plain data, so it pickles across ranks."""

    def __init__(self) -> None:
        self.acc: dict[str, list[Any]] = {}

    def add(self, metrics: dict[str, float], share: float) -> None:
        for k, v in metrics.items():
            how = kind_of(k)
            self._fold(k, how, float(v) * share if how is Combine.MEAN else float(v), share)

    def _fold(self, k: str, how: Combine, v: float, w: float) -> None:
        """``v``: the value as it accumulates (weighted already for a mean)."""
        if k not in self.acc:
            self.acc[k] = [how, v, w]
            return
        e = self.acc[k]
        e[1] = how.fold(e[1], v)
        e[2] += w

    @staticmethod
    def merge(parts: list[MetricSums]) -> dict[str, float]:
        total = MetricSums()
        for p in parts:
            for k, (how, v, w) in p.acc.items():
                total._fold(k, how, v, w)
        return {
            k: (v / w if w > 0 else 0.0) if how is Combine.MEAN else v
            for k, (how, v, w) in total.acc.items()
        }


def trajectory_metrics(trajs: list, learner_version: int) -> dict[str, Any]:
    """``reward/*``, ``response_length/*`` and ``staleness/*`` of the trajectories one
    step trained on (their ``learner.shard.RowSummary``: every rank's, on rank 0); every
    value a float but ``staleness/hist``, each trajectory's staleness (a histogram)."""
    import numpy as np

    rewards = np.array([t.reward for t in trajs], dtype=np.float64)
    stale = np.array([learner_version - t.min_version for t in trajs], dtype=np.int64)
    lengths = np.array([t.response_len for t in trajs], dtype=np.float64)
    groups: dict[str, list[float]] = {}
    for t, r in zip(trajs, rewards, strict=True):
        groups.setdefault(t.group_id, []).append(float(r))
    out: dict[str, Any] = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "reward/sum": float(rewards.sum()),
        "reward/count": float(len(rewards)),
        "reward/errors": float(sum(bool(t.error) for t in trajs)),
        # groups whose members all scored alike: no GRPO signal (DAPO's dynamic sampling)
        "reward/zero_variance_frac": sum(max(g) == min(g) for g in groups.values()) / len(groups),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        # stopped by the token limit, not by the model (veRL's response_length/clip_ratio)
        "response_length/clip_ratio": float(np.mean([t.finish_reason == "length" for t in trajs])),
        "staleness/mean": float(stale.mean()),
        "staleness/max": float(stale.max()),
        "staleness/hist": stale.tolist(),  # a list: the TensorBoard sink draws a histogram
        "tokens/trained": float(sum(t.mask_tokens for t in trajs)),  # not observations
        "tokens/trained_with_prompt": float(sum(t.num_tokens for t in trajs)),
    }
    keys = {k for t in trajs for k in t.reward_breakdown}
    for k in sorted(keys):
        # task/<name> (a mixture's per-task reward): over that task's trajectories only
        has = [t for t in trajs if k in t.reward_breakdown] if k.startswith("task/") else trajs
        out[f"reward/{k}"] = float(np.mean([t.reward_breakdown.get(k, 0.0) for t in has]))
    out.update(episode_metrics([t.episode for t in trajs]))
    return out


def episode_metrics(episodes: list[dict[str, float]]) -> dict[str, float]:
    """``env/*`` and ``perf/prefix_cache_hit_rate`` of multi-turn episodes (their
    ``Trajectory.episode``); nothing for single-turn ones. The hit rate is cached over
    prompt tokens of all the episodes' turn requests."""
    eps = [e for e in episodes if e]
    if not eps:
        return {}
    prompt = sum(e.get("turn_prompt_tokens", 0.0) for e in eps)
    out = {
        "env/turns_mean": sum(e.get("turns", 0.0) for e in eps) / len(eps),
        "env/tool_calls_mean": sum(e.get("tool_calls", 0.0) for e in eps) / len(eps),
        # seconds an episode awaited its env's steps (tools, gradings), summed over its turns
        "env/step_seconds_mean": sum(e.get("env_seconds", 0.0) for e in eps) / len(eps),
    }
    if prompt > 0:
        out["perf/prefix_cache_hit_rate"] = sum(e.get("cached_tokens", 0.0) for e in eps) / prompt
    return out
