"""Group advantage estimators against loops over groups."""

from __future__ import annotations

import hydra.utils
import pytest
import torch
from reference_losses import ref_advantages

from asyncrl.losses.advantages import GroupCentered, GroupNormalized, LeaveOneOut

ESTIMATORS = [("grpo", GroupNormalized()), ("drgrpo", GroupCentered()), ("rloo", LeaveOneOut())]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind,estimator", ESTIMATORS, ids=[e[0] for e in ESTIMATORS])
def test_matches_loop_reference(kind, estimator, seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(13, generator=g, dtype=torch.float64)
    group_ids = torch.randint(0, 5, (13,), generator=g) * 10 + 1  # unsorted, non-contiguous
    group_ids[0] = 999  # a group of one
    got = estimator(rewards, group_ids)
    want = torch.tensor(ref_advantages(kind, rewards, group_ids), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind,estimator", ESTIMATORS, ids=[e[0] for e in ESTIMATORS])
def test_edge_cases(kind, estimator):
    """Equal rewards in a group and groups of one carry no signal: advantage exactly 0.
    Binary rewards, float32: still finite and equal to the loop reference."""
    flat = estimator(torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.tensor([4, 4, 4, 7]))
    assert torch.equal(flat, torch.zeros(4))
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    ids = torch.tensor([2, 2, 2, 2, 5, 5])
    got = estimator(rewards, ids)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    torch.testing.assert_close(
        got, torch.tensor(ref_advantages(kind, rewards, ids)), rtol=1e-5, atol=1e-5
    )


def test_known_values():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    ids = torch.zeros(4, dtype=torch.int64)
    torch.testing.assert_close(
        GroupCentered()(rewards, ids), torch.tensor([0.75, -0.25, -0.25, -0.25])
    )
    torch.testing.assert_close(
        LeaveOneOut()(rewards, ids), torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3])
    )
    std = (0.75 * 0.25) ** 0.5
    torch.testing.assert_close(
        GroupNormalized(eps=0.0)(rewards, ids), torch.tensor([0.75, -0.25, -0.25, -0.25]) / std
    )


def test_built_from_target():
    est = hydra.utils.instantiate(
        {"_target_": "asyncrl.losses.advantages.GroupNormalized", "eps": 1e-4}
    )
    assert est.eps == 1e-4
