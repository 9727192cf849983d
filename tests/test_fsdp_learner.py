"""Two FSDP ranks (Ray actors, gloo, CPU) against one plain rank on the same batches.

The global batch is split across ranks by tokens and packed and micro-batched
differently on each side, so only fp32 summation order differs. Measured here (lr
1e-3, two steps, both normalisations): loss and grad norm agree to <= 2e-7 relative,
the update norm exactly; parameters to <= 1.1e-5 absolute, the whole update vector
to <= 3.3e-5 relative L2. Adam divides each gradient element by sqrt(v) + eps, so an
element whose gradient is near eps turns ~1e-9 reduction-order noise into a few
percent of ``lr``: hence a max-abs bound in units of ``lr`` next to the tight L2 one.
"""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch
from helpers import build_tiny_qwen, plain_optim, trajs

from asyncrl.config import ConfigError
from asyncrl.learner.batch import collate
from asyncrl.learner.config import LearnerSettings
from asyncrl.learner.group import LearnerGroup
from asyncrl.learner.learner import Learner
from asyncrl.losses.advantages import GroupNormalized
from asyncrl.losses.clipped import ClippedISLoss
from asyncrl.trajectory import Trajectory

pytestmark = pytest.mark.slow

LR = 1e-3
REL_TOL = 1e-6  # loss, grad norm, update norm, token-mean metrics (relative)
PARAM_ATOL = 0.05 * LR  # any single parameter after a step
UPDATE_REL_L2 = 1e-3  # ||update_2 - update_1|| / ||update_1||
LOGP_ATOL = 1e-5  # log-probs, packed differently on the two sides


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen(tmp_path_factory.mktemp("m"))


def sized(lens: list[tuple[int, int]], seed: int = 0) -> list[Trajectory]:
    """One group of trajectories with the given (prompt, response) lengths."""
    rng = np.random.default_rng(seed)
    return [
        Trajectory(
            f"s{i}",
            "g",
            rng.integers(1, 20, p),
            rng.integers(1, 20, r),
            -rng.random(r).astype(np.float32),
            np.zeros(r, np.int32),
            np.ones(r, bool),
            float(i % 2),
        )  # fmt: skip
        for i, (p, r) in enumerate(lens)
    ]


def close(a: float, b: float) -> bool:
    return abs(a - b) <= REL_TOL * max(abs(a), abs(b), 1e-12)


@pytest.mark.parametrize(
    "norm, minibatches, target",
    [("token", 1, None), ("sequence", 1, None), ("token", 2, None), ("token", 1, 1.0)],
)
def test_two_ranks_match_one(ray_local, model_dir, norm, minibatches, target):
    """``target``: the off-policy brake on (the test's random behaviour log-probs are far
    off the model's, so it binds): the KL it scales by is summed over both ranks."""
    torch.set_num_threads(1)
    optim = plain_optim(lr=LR, grad_clip=1e9, mismatch_kl_target=target)
    kw = dict(normalisation=norm, num_threads=1, minibatches=minibatches, optim=optim)
    steps = [
        collate(trajs(24, seed=3, max_prompt=9, max_response=12)),
        # rank 0 gets the 30-token sequence (one micro-batch), rank 1 the six short ones
        # (two): rank 0 runs an empty micro-batch to keep FSDP's collectives in step
        collate(sized([(10, 20)] + [(4, 4)] * 6)),
    ]
    one = Learner(
        str(model_dir), ClippedISLoss(), GroupNormalized(),
        LearnerSettings.defaults(micro_batch_tokens=10_000, **kw),
    )  # fmt: skip
    group = LearnerGroup(
        str(model_dir), ClippedISLoss(), GroupNormalized(),
        LearnerSettings.defaults(world_size=2, micro_batch_tokens=30, **kw),
    )  # fmt: skip
    try:
        before = one.full_state_dict()
        for v, batch in enumerate(steps):
            m1 = one.step_on_batch(batch, v)
            m2 = group.step_on_batch(batch, v)
            assert m2["learner/micro_batches"] >= m1["learner/micro_batches"] == minibatches
            assert m1["learner/optimizer_steps"] == m2["learner/optimizer_steps"] == minibatches
            for k in ("loss/total", "learner/grad_norm", "learner/update_norm", "is/ratio_mean",
                      "learner/lr_scale"):  # fmt: skip
                assert close(m1[k], m2[k]), (k, m1[k], m2[k])
            assert (m1["learner/lr_scale"] < 1) == (target is not None)
            p1 = one.full_state_dict()
            p2 = group.full_state_dict()
            assert p1.keys() == p2.keys() and "lm_head.weight" not in p2  # tied: dropped
            worst = max(float((p1[k] - p2[k]).abs().max()) for k in p1)
            assert worst < PARAM_ATOL, worst
            u1 = torch.cat([(p1[k] - before[k]).flatten() for k in p1])
            u2 = torch.cat([(p2[k] - before[k]).flatten() for k in p1])
            assert float((u1 - u2).norm() / u1.norm()) < UPDATE_REL_L2
            before = p1
        if (norm, minibatches, target) == ("token", 1, None):  # weights out, log-probs in
            # the FSDP group's store listens on loopback only, not on every interface
            # as torch's tcp:// init would (docs/security.md)
            from test_sockets import listening

            port = int(group.rendezvous.rpartition(":")[2])
            store = [r for r in listening([ray.get(group.ranks[0].pid.remote())]) if r[3] == port]
            assert [r[2] for r in store] == ["127.0.0.1"], store
            streamed = dict(group.named_parameters_stream())
            assert streamed.keys() == p2.keys()
            assert all(torch.equal(streamed[k], p2[k]) for k in p2)
            ts = trajs(9, seed=11)
            for a, b in zip(one.logprobs_of(ts), group.logprobs_of(ts)):
                np.testing.assert_allclose(a, b, atol=LOGP_ATOL)
    finally:
        group.close()


def test_world_size_beyond_the_cluster_fails_at_start(ray_local, model_dir):
    with pytest.raises(ConfigError, match=r"learner.world_size=64 .* need 64 CPUs .* has 4 CPUs"):
        LearnerGroup(
            str(model_dir),
            ClippedISLoss(),
            GroupNormalized(),
            LearnerSettings.defaults(world_size=64),
        )


def queue_items(ts: list[Trajectory]) -> list:
    """The trajectories as the queue hands them over: one object-store group per item."""
    from asyncrl.replay.buffer import BatchItem
    from asyncrl.trajectory import TrajectoryGroup

    groups: dict[str, list[Trajectory]] = {}
    for t in ts:
        groups.setdefault(t.group_id, []).append(t)
    return [
        BatchItem(ray.put(TrajectoryGroup(g, m)), g, [t.traj_id for t in m], [0] * len(m), 1)
        for g, m in groups.items()
    ]


def test_each_rank_fetches_its_share_and_two_match_one(ray_local, model_dir, tmp_path):
    """train_step from queue items: each rank decodes only its groups, and the step
    matches one rank's on the whole batch; rank 0 still logs every trajectory in order."""
    from asyncrl.learner.shard import Layout, RowSummary, share_items
    from asyncrl.utils.runlog import read_trajectories

    torch.set_num_threads(1)
    ts = trajs(24, seed=5, max_prompt=9, max_response=12)  # six groups of four
    items = queue_items(ts)
    owner = share_items(items, 2)
    assert sorted(owner) == [0, 0, 0, 1, 1, 1]
    per_rank = [
        [(k, [RowSummary.of(t) for t in ts if t.group_id == it.group_id])
         for k, it in enumerate(items) if owner[k] == r]
        for r in range(2)
    ]  # fmt: skip
    layout, whole = Layout.gathered(per_rank), Layout.of_batch(collate(ts))
    assert layout.lengths == whole.lengths and layout.mask_tokens == whole.mask_tokens
    assert torch.equal(layout.rewards, whole.rewards)
    assert torch.equal(layout.group_ids, whole.group_ids)

    optim = plain_optim(lr=LR, grad_clip=1e9)
    one = Learner(
        str(model_dir), ClippedISLoss(), GroupNormalized(),
        LearnerSettings.defaults(optim=optim, num_threads=1, micro_batch_tokens=10_000),
    )  # fmt: skip
    log = tmp_path / "trajectories"
    group = LearnerGroup(
        str(model_dir), ClippedISLoss(), GroupNormalized(),
        LearnerSettings.defaults(optim=optim, num_threads=1, world_size=2, micro_batch_tokens=30),
        trajectory_log=str(log),
    )  # fmt: skip
    try:
        m1 = one.train_step(items, 0)
        m2 = group.train_step(items, 0)
        for k in ("loss/total", "learner/grad_norm", "learner/update_norm", "is/ratio_mean"):
            assert close(m1[k], m2[k]), (k, m1[k], m2[k])
        for k in ("reward/mean", "reward/count", "staleness/max", "tokens/trained",
                  "tokens/trained_with_prompt", "learner/batch_trajectories"):  # fmt: skip
            assert m1[k] == m2[k], k
        p1, p2 = one.full_state_dict(), group.full_state_dict()
        assert max(float((p1[k] - p2[k]).abs().max()) for k in p1) < PARAM_ATOL
    finally:
        group.close()
    assert read_trajectories(log).column("traj_id").to_pylist() == [t.traj_id for t in ts]
