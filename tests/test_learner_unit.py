"""Learner pieces on a tiny random model: collation, micro-batch invariance of the
step under both normalisations, and the sampling-distribution log-probs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import build_tiny_qwen, plain_optim, trajs

from asyncrl.learner.batch import collate, token_budget_chunks
from asyncrl.learner.config import LearnerSettings
from asyncrl.learner.learner import Learner
from asyncrl.learner.logprobs import process_logits
from asyncrl.losses.advantages import GroupNormalized
from asyncrl.losses.clipped import ClippedISLoss


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen(tmp_path_factory.mktemp("m"))


def test_collate_layout():
    ts = trajs(5)
    b = collate(ts)
    for i, t in enumerate(ts):
        p, r = len(t.prompt_ids), len(t.response_ids)
        assert b.input_ids[i, :p].tolist() == t.prompt_ids.tolist()
        assert b.input_ids[i, p : p + r].tolist() == t.response_ids.tolist()
        assert int(b.attention_mask[i].sum()) == p + r
        assert b.mask[i].sum() == r and b.resp_start[i] == p
    assert b.group_ids.tolist() == [0, 0, 0, 0, 1]


def test_token_budget_chunks_cover_once_and_fit():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 50, 40).tolist()
    chunks = token_budget_chunks(lengths, 100)
    assert sorted(i for c in chunks for i in c) == list(range(40))
    for c in chunks:
        assert len(c) == 1 or len(c) * max(lengths[i] for i in c) <= 100


@pytest.mark.parametrize("norm", ["token", "sequence"])
def test_micro_batching_does_not_change_the_step(model_dir, norm):
    torch.set_num_threads(1)
    ts = trajs(12, seed=3)
    results = []
    for budget in (10_000, 24):  # one micro-batch vs many
        L = Learner(
            str(model_dir),
            ClippedISLoss(),
            GroupNormalized(),
            LearnerSettings.defaults(
                optim=plain_optim(lr=1e-2, grad_clip=1e9),
                micro_batch_tokens=budget,
                normalisation=norm,
            ),
        )
        m = L.step_on_batch(collate(ts), 0)
        results.append((m, [p.detach().clone() for p in L.model.parameters()]))
    (m1, p1), (m2, p2) = results
    assert m2["learner/micro_batches"] > 1 == m1["learner/micro_batches"]
    assert abs(m1["loss/total"] - m2["loss/total"]) < 1e-6
    assert abs(m1["learner/grad_norm"] - m2["learner/grad_norm"]) < 1e-5
    for a, b in zip(p1, p2):
        # fp32 summation order differs between micro-batchings; AdamW (lr 1e-2) turns that
        # ~1e-7 gradient noise into <= ~1e-5 parameter differences on near-zero gradients.
        torch.testing.assert_close(a, b, atol=2e-5, rtol=0)


def test_bf16_autocast_step_keeps_fp32_weights_and_near_fp32_logprobs(model_dir):
    """learner.autocast=bfloat16: the forward passes run in bf16 (AMX on a CPU) while the
    weights, the optimizer and the log-probs stay fp32; the step's log-probs and loss are
    the fp32 step's to bf16 precision, and the step moves the weights."""
    torch.set_num_threads(1)
    ts = trajs(12, seed=4)
    out = {}
    for mode in (None, "bfloat16"):
        L = Learner(str(model_dir), ClippedISLoss(), GroupNormalized(),
                    LearnerSettings.defaults(optim=plain_optim(lr=1e-2), autocast=mode))  # fmt: skip
        before = [p.detach().clone() for p in L.model.parameters()]
        lp = L.logprobs_of(ts)
        m = L.step_on_batch(collate(ts), 0)
        assert all(p.dtype == torch.float32 for p in L.model.parameters())
        assert any(not torch.equal(a, b) for a, b in zip(before, L.model.parameters()))
        out[mode] = (np.concatenate(lp), m)
    (lp32, m32), (lp16, m16) = out[None], out["bfloat16"]
    assert lp16.dtype == np.float32 and np.isfinite(lp16).all()
    assert not np.array_equal(lp16, lp32)  # bf16 really ran
    np.testing.assert_allclose(lp16, lp32, atol=0.05)  # bf16 logits: ~3 significant digits
    assert abs(m16["loss/total"] - m32["loss/total"]) < 0.05


def _reference_processed(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float
) -> np.ndarray:
    out = np.empty_like(logits, dtype=np.float64)
    for row in range(logits.shape[0]):
        z = logits[row].astype(np.float64) / temperature
        keep = np.ones_like(z, dtype=bool)
        if top_k:
            kth = np.sort(z)[::-1][top_k - 1]
            keep &= z >= kth
        if top_p < 1.0:
            zz = np.where(keep, z, -np.inf)
            p = np.exp(zz - zz.max())
            p /= p.sum()
            order = np.argsort(p)  # ascending
            cum = 0.0
            for j in order[:-1]:  # never drop the most likely
                cum += p[j]
                if cum <= 1 - top_p:
                    keep[j] = False
        zz = np.where(keep, z, -np.inf)
        m = zz.max()
        out[row] = zz - (m + np.log(np.exp(zz - m).sum()))
    return out


@pytest.mark.parametrize(
    "t,k,p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0), (1.3, 0, 0.8), (0.9, 5, 0.9)]
)
def test_processed_logprobs_match_reference(t, k, p):
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(0)) * 3
    got = process_logits(logits, t, k, p).double().numpy()
    want = _reference_processed(logits.numpy(), t, k, p)
    assert np.array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got[~np.isinf(got)], want[~np.isinf(want)], atol=1e-5)


def test_greedy_is_refused():
    with pytest.raises(ValueError, match="temperature"):
        process_logits(torch.zeros(2, 3), 0.0)


def test_the_rank_exposes_its_held_parts_methods_as_its_own():
    """What Ray calls on a rank (the brokers' weight methods) has the held
    ``WeightsOut``'s names and signatures, so ``ray.remote(Learner)`` checks calls alike."""
    import inspect

    from asyncrl.learner.weights import WeightsOut

    names = [
        "attach_broker",
        "snapshot_weights",
        "detach_broker",
        "weight_digests",
        "shard_digests",
        "weights_ref",
        "stream_weights",
        "full_state_dict",
    ]
    for name in names:
        mine, held = getattr(Learner, name), getattr(WeightsOut, name)
        assert inspect.signature(mine) == inspect.signature(held), name
        assert mine.__doc__ == held.__doc__, name


def test_the_ray_class_of_a_rank_calls_the_learner_with_its_signatures():
    """``LearnerRank`` (what Ray makes remote) has every method the driver and the
    brokers call on a rank, each with the Learner's signature, and a generator where
    Ray streams; the transfers in the weights concurrency group."""
    import inspect

    from asyncrl.broker.messages import WEIGHTS_GROUP
    from asyncrl.learner.rank import LearnerRank

    def params(method) -> list:  # less what Ray's tracing adds once a class is made remote
        return [p for p in inspect.signature(method).parameters.values()
                if p.name != "_ray_trace_ctx"]  # fmt: skip

    names = [n for n in vars(LearnerRank) if not n.startswith("_")]
    assert len(names) == 18, names
    for name in names:
        mine, theirs = getattr(LearnerRank, name), getattr(Learner, name)
        assert params(mine) == params(theirs), name
        assert (
            inspect.signature(mine).return_annotation == inspect.signature(theirs).return_annotation
        )
    assert inspect.isgeneratorfunction(LearnerRank.stream_weights)
    for name in ("send_weights", "close_send_groups"):
        assert getattr(LearnerRank, name).__ray_concurrency_group__ == WEIGHTS_GROUP


def test_a_batch_without_a_trained_token_takes_no_step(model_dir):
    """Every episode ended before the model wrote a token (an env failing at its start,
    an agent that never called): no gradient, so no optimizer step (AdamW's decay would
    still move the weights); the version moves on and the metrics say so."""
    from asyncrl.trajectory import Trajectory

    empty = np.zeros(0, np.int64)
    ts = [
        Trajectory(f"t{i}", "g0", np.array([1, 2, 3]), empty, np.zeros(0, np.float32),
                   np.zeros(0, np.int32), np.zeros(0, bool), 0.0)
        for i in range(4)
    ]  # fmt: skip
    L = Learner(str(model_dir), ClippedISLoss(), GroupNormalized(),
                LearnerSettings.defaults(optim=plain_optim(lr=1e-2)))  # fmt: skip
    before = [p.detach().clone() for p in L.model.parameters()]
    m = L.step_on_batch(collate(ts), 0)
    assert m["learner/empty_batch"] == 1.0 and m["learner/optimizer_steps"] == 0
    assert L.version == 1
    assert all(torch.equal(a, b) for a, b in zip(before, L.model.parameters()))
    m = L.step_on_batch(collate(trajs(4, seed=1)), 1)  # a real batch after it trains
    assert "learner/empty_batch" not in m and m["learner/optimizer_steps"] >= 1
