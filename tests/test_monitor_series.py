"""The series users expect (veRL / TRL names): response length, truncation, reward std,
zero-variance groups, the staleness histogram in TensorBoard, the policy entropy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncrl.learner.metrics import trajectory_metrics
from asyncrl.learner.shard import RowSummary


def _row(reward: float, group: str, length: int, min_version: int, finish: str = "stop"):
    return RowSummary(
        num_tokens=length + 3, mask_tokens=length, response_len=length, reward=reward,
        group_id=group, min_version=min_version, finish_reason=finish,
    )  # fmt: skip


def test_trajectory_series_values():
    rows = [
        _row(1.0, "a", 4, 10), _row(1.0, "a", 6, 10),  # group a: all alike
        _row(0.0, "b", 8, 9, "length"), _row(1.0, "b", 2, 8),
        _row(0.0, "c", 8, 7, "length"), _row(0.0, "c", 5, 10),  # group c: all alike
    ]  # fmt: skip
    m = trajectory_metrics(rows, 10)
    rewards = [1, 1, 0, 1, 0, 0]
    mean = sum(rewards) / 6
    assert m["reward/mean"] == pytest.approx(mean)
    assert m["reward/std"] == pytest.approx(math.sqrt(sum((r - mean) ** 2 for r in rewards) / 6))
    assert m["reward/zero_variance_frac"] == pytest.approx(2 / 3)
    assert m["response_length/mean"] == pytest.approx(33 / 6)
    assert m["response_length/max"] == 8
    assert m["response_length/clip_ratio"] == pytest.approx(2 / 6)
    assert m["staleness/hist"] == [0, 0, 1, 2, 3, 0]
    assert m["staleness/max"] == 3


def test_staleness_histogram_reaches_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from asyncrl.utils.runlog import Scalars

    s = Scalars(tmp_path)
    s.log(1, {"reward/mean": 0.5, "staleness/hist": [0, 1, 1, 2, 4]})
    s.close()
    ea = EventAccumulator(str(tmp_path))
    ea.Reload()
    assert "reward/mean" in ea.Tags()["scalars"]
    (h,) = ea.Histograms("staleness/hist")
    assert h.step == 1 and h.histogram_value.num == 5
    assert h.histogram_value.min == 0 and h.histogram_value.max == 4
    assert h.histogram_value.sum == 8


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_matches_a_float64_loop(temperature):
    from asyncrl.learner.tokenlog import entropy_metric

    torch.manual_seed(0)
    logits = torch.randn(7, 11)
    seq = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    tok = torch.tensor([0, 1, 2, 0, 1, 2, 3])
    mask = torch.tensor([[True, True, False, False], [True, False, True, True]])

    class Pk:
        pass

    pk = Pk()
    pk.seq, pk.tok = seq, tok
    got = entropy_metric(logits, pk, mask, temperature, 0, 1.0)["actor/entropy"]
    ents = []
    for n in range(7):
        if not mask[seq[n], tok[n]]:
            continue
        z = logits[n].double().numpy() / temperature
        p = np.exp(z - z.max())
        p /= p.sum()
        ents.append(-sum(x * math.log(x) for x in p))
    assert got == pytest.approx(sum(ents) / len(ents), rel=1e-5)
