"""Exact resume on two FSDP ranks, and a two-rank checkpoint loaded on one rank.

Run A trains K steps, saves, trains M more; run B (fresh ranks) loads A's checkpoint
and trains the same M batches: bit-identical parameters (gloo sums two ranks in a fixed
order, so nothing is left to chance on CPU).
"""

from __future__ import annotations

import pytest
import torch
from helpers import build_tiny_qwen, plain_optim, trajs

from asyncrl.learner.batch import collate
from asyncrl.learner.config import LearnerSettings
from asyncrl.learner.group import LearnerGroup
from asyncrl.learner.learner import Learner
from asyncrl.losses.advantages import GroupNormalized
from asyncrl.losses.vtrace import VTraceLoss

pytestmark = pytest.mark.slow

K, M = 2, 2
OPTIM = plain_optim(lr=1e-2, warmup_steps=1, schedule="cosine", total_steps=6, value_lr=2e-2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen(tmp_path_factory.mktemp("m"))


def group(model_dir) -> LearnerGroup:
    settings = LearnerSettings.defaults(
        optim=OPTIM, world_size=2, micro_batch_tokens=40, value_head=True, num_threads=1
    )
    return LearnerGroup(
        str(model_dir), VTraceLoss(use_value_head=True), GroupNormalized(), settings, seed=1
    )


def test_resume_on_two_ranks_is_bit_exact(ray_local, model_dir, tmp_path):
    torch.set_num_threads(1)
    bs = [collate(trajs(16, seed=200 + i)) for i in range(K + M)]
    ck = str(tmp_path / "ck")
    a = group(model_dir)
    try:
        for v in range(K):
            a.step_on_batch(bs[v], v)
        a.save(ck, {"samplers": {"actor0": {"drawn": 7}}})
        at_k = a.full_state_dict()
        tail_a = [a.step_on_batch(bs[v], v) for v in range(K, K + M)]
        final_a = a.full_state_dict()
    finally:
        a.close()
    b = group(model_dir)
    try:
        meta = b.load(ck)
        assert meta["version"] == K and meta["driver_state"]["samplers"]["actor0"]["drawn"] == 7
        tail_b = [b.step_on_batch(bs[v], v) for v in range(K, K + M)]
        final_b = b.full_state_dict()
    finally:
        b.close()
    assert final_a.keys() == final_b.keys()
    for k in final_a:
        assert torch.equal(final_a[k], final_b[k]), k
    for ma, mb in zip(tail_a, tail_b):
        for key in ("loss/total", "learner/grad_norm", "learner/update_norm", "learner/lr"):
            assert ma[key] == mb[key], key

    # the same checkpoint, resharded onto one rank
    one = Learner(
        str(model_dir), VTraceLoss(use_value_head=True), GroupNormalized(),
        LearnerSettings.defaults(optim=OPTIM, micro_batch_tokens=40, value_head=True),
    )  # fmt: skip
    assert one.load(ck)["version"] == K
    sd = one.full_state_dict()
    assert all(torch.equal(sd[k], at_k[k]) for k in at_k)
