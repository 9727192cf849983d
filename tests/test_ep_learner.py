"""Expert parallelism in the learner (``learner.ep``): two ranks (Ray actors, gloo, CPU),
each holding half of every MoE layer's experts, tokens sent to them by all-to-all,
against one plain rank on the same batches; four ranks as two data-parallel copies of
that (``ep=2``, mesh ``("dp", "ep")`` = (2, 2)), likewise; four ranks as TP2 x EP2 (the
attention split over ``tp``, the experts over ``ep`` = the ``tp`` pairs, each ``tp`` rank
routing half of its pair's tokens), likewise; and the start-up refusals.

The two sides sum the same fp32 products in another order (a token's expert outputs
come back over gloo and are added on its own rank; each expert's gradient adds the
two ranks' tokens in one matmul), so they are not bit-exact. Measured here (lr 1e-3,
fp32, the clip binding): loss, grad norm, update norm and IS ratio to <= 1.8e-7
relative, log-probs to <= 9.6e-7, exported weights after two steps to <= 4.1e-6 absolute
(docs/parallelism.md); the bounds below leave room.
"""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch
from helpers import plain_optim, trajs
from test_fsdp_learner import queue_items
from test_routing_replay import PERTURB, record

from asyncrl.config import ConfigError
from asyncrl.learner.batch import collate
from asyncrl.learner.config import LearnerSettings
from asyncrl.learner.expert_parallel import expert_modules
from asyncrl.learner.group import LearnerGroup
from asyncrl.learner.learner import Learner
from asyncrl.learner.moe_check import check_model
from asyncrl.learner.rank import LearnerRank
from asyncrl.learner.tensor_parallel import check_model as check_tp
from asyncrl.losses.advantages import GroupNormalized
from asyncrl.losses.clipped import ClippedISLoss
from asyncrl.models.tiny import random_qwen2, random_qwen3_moe

LR = 1e-3
REL_TOL = 1e-6  # loss, grad norm, update norm (relative)
LOGP_ATOL = 1e-5
PARAM_ATOL = 0.05 * LR  # Adam turns order noise in a near-eps gradient into ~lr moves
GRAD_CLIP = 0.05
KEYS = ("loss/total", "learner/grad_norm", "learner/update_norm", "is/ratio_mean")
EXPERTS = 4


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A random Qwen3-MoE (hidden 64, 2 layers, 2 heads of 32, 4 experts of 32, top-2)."""
    d = tmp_path_factory.mktemp("moe")
    random_qwen3_moe(20, 64, 2, 2, 2, 32, EXPERTS, 2, tie=True, out_dir=d, pad_token_id=0)
    return d


def settings(**values) -> LearnerSettings:
    optim = plain_optim(lr=LR, grad_clip=GRAD_CLIP)
    replay = {"routing_replay": True}
    return LearnerSettings.defaults(optim=optim, num_threads=1, moe=replay, **values)


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"world_size": 3, "ep": 2}, "learner.ep=2 does not divide learner.world_size=3"),
        ({"world_size": 4, "ep": 2, "tp": 4}, "learner.ep=2 with learner.tp=4: ep must be a"),
        ({"world_size": 8, "ep": 4, "tp": 8}, "learner.ep=4 with learner.tp=8: ep must be a"),
        ({"ep": 0}, "learner.ep=0: expected an integer in [1, 64]"),
    ],
)
def test_bad_ep_is_refused_in_one_line(values, says):
    with pytest.raises(ConfigError) as e:
        settings(**values)
    assert str(e.value).startswith(says) and "\n" not in str(e.value), str(e.value)


def test_ep_dividing_world_size_is_accepted():
    assert settings(world_size=4, ep=2).ep == 2
    assert settings(world_size=4, ep=2, tp=2).ep == 2  # tp divides ep
    assert settings(world_size=8, ep=4, tp=2).ep == 4


def test_tp_on_a_moe_model_needs_ep(moe_dir):
    """Tensor parallelism splits a MoE model's attention; its experts go by ``learner.ep``."""
    check_tp(str(moe_dir), 2, 2)  # 2 heads, 2 key/value heads, 4 experts
    with pytest.raises(ConfigError, match=r"^learner.tp=2: model .* has experts, which"):
        check_tp(str(moe_dir), 2, 1)
    with pytest.raises(ConfigError, match=r"^learner.tp=4: model .* num_attention_heads=2"):
        check_tp(str(moe_dir), 4, 4)


def test_the_model_must_have_experts_ep_divides(moe_dir, tmp_path):
    check_model(str(moe_dir), 2)  # 4 experts, 2 ways
    with pytest.raises(
        ConfigError, match=r"^learner.ep=3 does not divide the model's num_experts=4"
    ):
        check_model(str(moe_dir), 3)
    random_qwen2(20, 64, 2, 2, 2, 96, tie=True, out_dir=tmp_path, pad_token_id=0)
    with pytest.raises(ConfigError, match=r"^learner.ep=2: model .* is dense"):
        check_model(str(tmp_path), 2)


@pytest.mark.slow
def test_ep2_matches_one_rank(ray_local, moe_dir, tmp_path):
    """Two steps (a collated batch every rank holds, then queue items shared between the
    ranks, carrying recorded experts that both sides replay) on EP2 and on one rank: same
    loss, grad norm, update norm, expert disagreement; the exported full weights (what
    the brokers send) and log-probs agree. Its checkpoint loads on one rank."""
    torch.set_num_threads(1)
    first = collate(trajs(24, seed=3, max_prompt=9, max_response=12))
    recorded = trajs(24, seed=5, max_prompt=9, max_response=12)
    record(moe_dir, recorded, noise=PERTURB)  # through the queue to both, replayed by both
    second = queue_items(recorded)
    one = Learner(str(moe_dir), ClippedISLoss(), GroupNormalized(),
                  settings(micro_batch_tokens=10_000))  # fmt: skip
    ep = LearnerGroup(str(moe_dir), ClippedISLoss(), GroupNormalized(),
                      settings(world_size=2, ep=2, micro_batch_tokens=40))  # fmt: skip

    def first_experts(rank: LearnerRank) -> tuple[int, float]:
        """On a rank (a closure: Ray sends it by value): how many experts of layer 0 its
        learner holds, and their weights' sum."""
        w = expert_modules(rank.learner.model)[0].gate_up_proj.to_local()
        return w.shape[0], float(w.detach().sum())

    try:
        held = ray.get([r.__ray_call__.remote(first_experts) for r in ep.ranks])
        full = one.model.model.layers[0].mlp.experts.gate_up_proj.detach()
        halves = [float(full[: EXPERTS // 2].sum()), float(full[EXPERTS // 2 :].sum())]
        for r in range(2):  # each rank holds its own half of every layer's experts
            assert held[r] == (EXPERTS // 2, pytest.approx(halves[r], rel=1e-6))
        steps = [(one.step_on_batch(first, 0), ep.step_on_batch(first, 0))]
        steps.append((one.train_step(second, 1), ep.train_step(second, 1)))
        worst = {k: max(rel(a[k], b[k]) for a, b in steps) for k in KEYS}
        print("EP2 vs one rank, worst relative difference:", worst)
        assert all(v <= REL_TOL for v in worst.values()), worst
        assert steps[1][0]["learner/grad_norm"] > GRAD_CLIP  # the clip binds
        d = [m["moe/expert_disagreement"] for m in steps[1]]
        print("moe/expert_disagreement (one rank, EP2):", d)
        assert 0 < d[0] < 1 and abs(d[0] - d[1]) < 1e-9, d
        p1, p2 = one.full_state_dict(), ep.full_state_dict()
        w = "model.layers.0.mlp.experts.gate_up_proj"
        assert p2[w].shape == p1[w].shape and p2[w].shape[0] == EXPERTS  # whole, not shards
        print("exported weights, max |diff|:", max_diff(p1, p2))
        assert max_diff(p1, p2) < PARAM_ATOL
        streamed = dict(ep.named_parameters_stream())
        assert all(torch.equal(streamed[k], p2[k]) for k in p2)
        ts = trajs(9, seed=11)
        d = max(float(np.abs(a - b).max()) for a, b in zip(one.logprobs_of(ts), ep.logprobs_of(ts)))
        print("log-probs, max |diff|:", d)
        assert d < LOGP_ATOL
        ep.save(str(tmp_path / "ck"))  # each rank's experts into one global tensor
    finally:
        ep.close()
    single = Learner(str(moe_dir), ClippedISLoss(), GroupNormalized(),
                     settings(micro_batch_tokens=10_000))  # fmt: skip
    assert single.load(str(tmp_path / "ck"))["version"] == 2
    assert max_diff(single.full_state_dict(), p2) == 0.0  # resumes on one rank, bit-exact


@pytest.mark.slow
def test_ep2_dp2_matches_one_rank(ray_local, moe_dir, tmp_path):
    """Four ranks, ``ep=2`` (two data-parallel copies of an EP2 pair: tokens all-to-all
    within each pair, each expert FSDP-sharded over the two ranks holding it, its
    gradient summed over them) against one rank: the same two steps as above give the
    same loss, grad norm, update norm; the streamed full weights (what the brokers send)
    agree; a checkpoint written at (dp 2, ep 2) resumes on one rank to the same weights
    and the same next-step loss."""
    torch.set_num_threads(1)
    first = collate(trajs(24, seed=3, max_prompt=9, max_response=12))
    recorded = trajs(24, seed=5, max_prompt=9, max_response=12)
    record(moe_dir, recorded, noise=PERTURB)
    second = queue_items(recorded)
    one = Learner(str(moe_dir), ClippedISLoss(), GroupNormalized(),
                  settings(micro_batch_tokens=10_000))  # fmt: skip
    grp = LearnerGroup(str(moe_dir), ClippedISLoss(), GroupNormalized(),
                       settings(world_size=4, ep=2, micro_batch_tokens=40))  # fmt: skip

    def first_experts(rank: LearnerRank) -> tuple[int, float]:
        """On a rank: how many rows of layer 0's experts it holds, and their sum."""
        w = expert_modules(rank.learner.model)[0].gate_up_proj.to_local()
        return w.shape[0], float(w.detach().sum())

    try:
        held = ray.get([r.__ray_call__.remote(first_experts) for r in grp.ranks])
        full = one.model.model.layers[0].mlp.experts.gate_up_proj.detach()
        for r in range(4):  # rank (dp d, ep e): expert 2e + d (ep half e, FSDP row d)
            d, e = divmod(r, 2)
            assert held[r] == (1, pytest.approx(float(full[2 * e + d].sum()), rel=1e-6))
        steps = [(one.step_on_batch(first, 0), grp.step_on_batch(first, 0))]
        steps.append((one.train_step(second, 1), grp.train_step(second, 1)))
        worst = {k: max(rel(a[k], b[k]) for a, b in steps) for k in KEYS}
        print("EP2 x DP2 vs one rank, worst relative difference:", worst)
        assert all(v <= REL_TOL for v in worst.values()), worst
        assert steps[1][0]["learner/grad_norm"] > GRAD_CLIP  # the clip binds
        p1, streamed = one.full_state_dict(), dict(grp.named_parameters_stream())
        assert streamed.keys() == p1.keys()
        w = "model.layers.0.mlp.experts.gate_up_proj"
        assert streamed[w].shape == p1[w].shape  # whole, not shards
        print("streamed weights, max |diff|:", max_diff(p1, streamed))
        assert max_diff(p1, streamed) < PARAM_ATOL
        grp.save(str(tmp_path / "ck"))
        third = queue_items(trajs(24, seed=7, max_prompt=9, max_response=12))
        after = grp.train_step(third, 2)
    finally:
        grp.close()
    single = Learner(str(moe_dir), ClippedISLoss(), GroupNormalized(),
                     settings(micro_batch_tokens=10_000))  # fmt: skip
    assert single.load(str(tmp_path / "ck"))["version"] == 2
    assert max_diff(single.full_state_dict(), streamed) == 0.0  # bit-exact
    resumed = single.train_step(third, 2)
    print("next step after resume, relative:", {k: rel(after[k], resumed[k]) for k in KEYS})
    assert all(rel(after[k], resumed[k]) <= REL_TOL for k in KEYS)


@pytest.fixture(scope="module")
def preset_moe_dir(tmp_path_factory):
    """``model=tiny_moe``'s architecture (hidden 128, 2 layers, 4 heads of 32, 2 key/value
    heads, 8 experts of 64, top-2) at random weights over the tests' 20-token vocabulary
    (the preset's warm start takes minutes)."""
    from helpers import composed

    t = composed("model=tiny_moe").model.tiny
    d = tmp_path_factory.mktemp("preset_moe")
    random_qwen3_moe(20, t.hidden_size, t.num_layers, t.num_heads, t.num_kv_heads,
                     t.intermediate_size, t.num_experts, t.experts_per_token, tie=True,
                     out_dir=d, pad_token_id=0)  # fmt: skip
    return d


@pytest.mark.slow
def test_tp2_ep2_matches_one_rank(ray_local, preset_moe_dir, tmp_path):
    """Four ranks, ``tp=2 ep=2`` (mesh ``("dp", "tp")`` = (2, 2) for the attention, each
    ``tp`` pair an ``ep`` pair for the experts, each expert FSDP-sharded over the two
    ranks holding it) against one rank: the same two steps as above (the second replaying
    recorded experts) give the same loss, grad norm, update norm, expert disagreement;
    the streamed full weights and log-probs agree; a checkpoint written at this layout
    resumes on one rank to the same weights and the same next step."""
    torch.set_num_threads(1)
    model = str(preset_moe_dir)
    first = collate(trajs(24, seed=3, max_prompt=9, max_response=12))
    recorded = trajs(24, seed=5, max_prompt=9, max_response=12)
    record(preset_moe_dir, recorded, noise=PERTURB)
    second = queue_items(recorded)
    one = Learner(model, ClippedISLoss(), GroupNormalized(), settings(micro_batch_tokens=10_000))
    grp = LearnerGroup(model, ClippedISLoss(), GroupNormalized(),
                       settings(world_size=4, tp=2, ep=2, micro_batch_tokens=40))  # fmt: skip

    def held(rank: LearnerRank) -> tuple[int, float, int]:
        """On a rank: the rows of layer 0's experts it holds and their sum, and the rows
        of layer 0's query projection (split over tp, then sharded over dp)."""
        layer = rank.learner.model.model.layers[0]
        w = layer.mlp.experts.gate_up_proj.to_local()
        return (
            w.shape[0],
            float(w.detach().sum()),
            layer.self_attn.q_proj.weight.to_local().shape[0],
        )

    try:
        got = ray.get([r.__ray_call__.remote(held) for r in grp.ranks])
        layer = one.model.model.layers[0]
        full, q_rows = (
            layer.mlp.experts.gate_up_proj.detach(),
            layer.self_attn.q_proj.weight.shape[0],
        )
        for r in range(4):  # rank (dp d, tp t): ep half t, FSDP quarter d: experts 4t+2d, +1
            d, t = divmod(r, 2)
            mine = float(full[4 * t + 2 * d : 4 * t + 2 * d + 2].sum())
            assert got[r] == (2, pytest.approx(mine, rel=1e-6), q_rows // 4), (r, got[r])
        steps = [(one.step_on_batch(first, 0), grp.step_on_batch(first, 0))]
        steps.append((one.train_step(second, 1), grp.train_step(second, 1)))
        worst = {k: max(rel(a[k], b[k]) for a, b in steps) for k in KEYS}
        print("TP2 x EP2 vs one rank, worst relative difference:", worst)
        assert all(v <= REL_TOL for v in worst.values()), worst
        assert steps[1][0]["learner/grad_norm"] > GRAD_CLIP  # the clip binds
        d = [m["moe/expert_disagreement"] for m in steps[1]]
        print("moe/expert_disagreement (one rank, TP2 x EP2):", d)
        assert 0 < d[0] < 1 and abs(d[0] - d[1]) < 1e-9, d
        p1, streamed = one.full_state_dict(), dict(grp.named_parameters_stream())
        assert streamed.keys() == p1.keys()
        assert all(streamed[k].shape == p1[k].shape for k in p1)  # whole, not shards
        print("streamed weights, max |diff|:", max_diff(p1, streamed))
        assert max_diff(p1, streamed) < PARAM_ATOL
        ts = trajs(9, seed=11)
        d = max(
            float(np.abs(a - b).max()) for a, b in zip(one.logprobs_of(ts), grp.logprobs_of(ts))
        )
        print("log-probs, max |diff|:", d)
        assert d < LOGP_ATOL
        grp.save(str(tmp_path / "ck"))
        third = queue_items(trajs(24, seed=7, max_prompt=9, max_response=12))
        after = grp.train_step(third, 2)
    finally:
        grp.close()
    single = Learner(model, ClippedISLoss(), GroupNormalized(), settings(micro_batch_tokens=10_000))
    assert single.load(str(tmp_path / "ck"))["version"] == 2
    assert max_diff(single.full_state_dict(), streamed) == 0.0  # bit-exact
    resumed = single.train_step(third, 2)
    print("next step after resume, relative:", {k: rel(after[k], resumed[k]) for k in KEYS})
    assert all(rel(after[k], resumed[k]) <= REL_TOL for k in KEYS)
