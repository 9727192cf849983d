"""Routing replay on the learner (``learner.moe.routing_replay``): one rank, a random
Qwen3-MoE, trajectories carrying the experts a router chose for every position.

Records from the learner's own router replay to the same log-probs (the positions line
up through packing); records from a perturbed router differ from the learner's own
top-k on some tokens, and with replay the learner routes every recorded token to the
recorded experts while its router still trains."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import plain_optim, replayed, trajs

from asyncrl.config import ConfigError
from asyncrl.learner.batch import collate
from asyncrl.learner.config import LearnerSettings
from asyncrl.learner.learner import Learner
from asyncrl.learner.model import load_lm
from asyncrl.learner.moe_check import check_model
from asyncrl.learner.routing import routers
from asyncrl.losses.advantages import GroupNormalized
from asyncrl.losses.clipped import ClippedISLoss
from asyncrl.models.tiny import random_qwen2, random_qwen3_moe
from asyncrl.trajectory import from_bytes, to_bytes

PERTURB = 0.02  # router noise (weights ~0.02): some tokens' top-2 change, most do not


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    random_qwen3_moe(20, 64, 2, 2, 2, 32, 4, 2, tie=True, out_dir=d, pad_token_id=0)
    return d


def learner(model_dir, replay: bool) -> Learner:
    s = LearnerSettings.defaults(optim=plain_optim(lr=1e-3), num_threads=1,
                                 micro_batch_tokens=10_000, moe={"routing_replay": replay})  # fmt: skip
    return Learner(str(model_dir), ClippedISLoss(), GroupNormalized(), s)


@torch.no_grad()
def record(model_dir, ts, noise: float) -> None:
    """Set every trajectory's ``routed_experts`` from an HF forward of prompt + response
    through the model with ``noise`` added to its routers (seeded)."""
    lm = load_lm(str(model_dir)).eval()
    gen = torch.Generator().manual_seed(0)
    for r in routers(lm):
        r.weight.add_(noise * torch.randn(r.weight.shape, generator=gen))
    seen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, i, o: seen.append(o[2])) for r in routers(lm)]
    for t in ts:
        seen.clear()
        ids = torch.from_numpy(np.concatenate([t.prompt_ids, t.response_ids])).long()[None]
        lm(input_ids=ids)
        t.routed_experts = torch.stack(seen, 1).numpy().astype(np.uint8)  # [n, layers, K]
    for h in hooks:
        h.remove()


def test_own_records_replay_to_the_same_logprobs(moe_dir):
    ts = trajs(12, seed=3, max_prompt=9, max_response=12)
    plain = learner(moe_dir, replay=False).logprobs_of(ts)
    record(moe_dir, ts, noise=0.0)
    assert from_bytes(to_bytes(ts))[0].routed_experts.tolist() == ts[0].routed_experts.tolist()
    ln = learner(moe_dir, replay=True)
    for a, b in zip(plain, ln.logprobs_of(ts), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    n, differ = replayed(ln)
    assert (n, differ) == (2 * sum(t.num_tokens for t in ts), 0)


def test_replay_routes_every_recorded_token_as_recorded(moe_dir):
    ts = trajs(12, seed=5, max_prompt=9, max_response=12)
    record(moe_dir, ts, noise=PERTURB)
    own, replay = learner(moe_dir, replay=False), learner(moe_dir, replay=True)
    own.logprobs_of(ts)
    n, differ = replayed(own)
    print(f"without replay: {differ} of {n} (position, layer) pairs routed elsewhere")
    assert n == 2 * sum(t.num_tokens for t in ts) and 0 < differ < n
    replay.logprobs_of(ts)
    assert replayed(replay) == (n, 0)  # every recorded token, every layer
    gate = "model.layers.0.mlp.gate.weight"
    before = replay.model.get_parameter(gate).detach().clone()
    m_own = own.step_on_batch(collate(ts), 0)
    m_rep = replay.step_on_batch(collate(ts), 0)
    assert replayed(replay)[1] == 0
    # layer 0's own top-k is the same either way; replay changes what later layers see
    print(
        "moe/expert_disagreement:",
        m_own["moe/expert_disagreement"],
        m_rep["moe/expert_disagreement"],
    )
    assert m_own["moe/expert_disagreement"] == pytest.approx(differ / n)  # as counted above
    assert 0 < m_own["moe/expert_disagreement"] < 1 and 0 < m_rep["moe/expert_disagreement"] < 1
    assert m_own["loss/total"] != m_rep["loss/total"]
    assert (replay.model.get_parameter(gate).detach() - before).abs().max() > 0  # it trains


def test_replay_on_a_dense_model_is_refused(tmp_path):
    random_qwen2(20, 64, 2, 2, 2, 96, tie=True, out_dir=tmp_path, pad_token_id=0)
    with pytest.raises(ConfigError, match=r"^learner.moe.routing_replay=true: model .* dense"):
        check_model(str(tmp_path), 1, routing_replay=True)


def test_recording_routes_is_decided_and_checked_before_ray(tmp_path):
    """``actor.record_experts``: null follows ``learner.moe.routing_replay``; a record the
    engine cannot make (prefix cache, dense model) or a replay with nothing recorded is
    refused naming the key."""
    from asyncrl.actor.settings import ActorSettings

    assert ActorSettings.defaults().record_experts is None
    assert ActorSettings.defaults().recording(True).record_experts is True
    assert ActorSettings.defaults().recording(False).record_experts is False
    assert ActorSettings.defaults(record_experts=True).recording(False).record_experts is True
    with pytest.raises(ConfigError, match=r"^learner.moe.routing_replay=true with actor.reco"):
        ActorSettings.defaults(record_experts=False).recording(True)
    cached = ActorSettings.defaults(engine={"enable_prefix_caching": True})
    with pytest.raises(ConfigError, match=r"^actor.record_experts on with .*prefix_caching"):
        cached.recording(True)
    random_qwen2(20, 64, 2, 2, 2, 96, tie=True, out_dir=tmp_path, pad_token_id=0)
    with pytest.raises(ConfigError, match=r"^actor.record_experts=true: model .* dense"):
        check_model(str(tmp_path), 1, record_experts=True)
