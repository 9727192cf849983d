"""The engine seam's contract (asyncrl/engine/protocol.py ``Engine``), held by every
implementation: tests/fake_engine.py's FakeEngine, vLLM (the session's one engine,
tests/conftest.py ``vllm_actor``, the tiny model) and SGLangEngine over the fake of
SGLang's Engine (tests/fake_sglang.py, the tiny model run by transformers: SGLang
itself cannot run here, docs/engines.md)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from fake_engine import FakeEngine

from asyncrl.actor.weights import WeightUpdates
from asyncrl.engine.protocol import Sampling, version_salt

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "3+4="
HELD_S = 0.5  # a paused engine must still hold a request this long after it was sent


@pytest.fixture(params=["fake", "sglang", pytest.param("vllm", marks=pytest.mark.slow)])
def engine(request, tiny_model):
    if request.param == "fake":
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast(tokenizer_file=str(tiny_model / "tokenizer.json"))
        yield FakeEngine(tok, seed=0)
    elif request.param == "sglang":
        from fake_sglang import installed

        from asyncrl.engine.backend import make_engine
        from asyncrl.engine.settings import EngineSettings

        with installed():  # SGLangEngine imports sglang in its calls
            eng = make_engine(str(tiny_model), EngineSettings.defaults(backend="sglang"), 0)
            yield eng
            eng.shutdown()
    else:
        yield request.getfixturevalue("vllm_actor").engine


def model_state(tiny_model, noise_seed: int | None) -> dict:
    """The tiny model's weights, nudged by seeded noise unless ``noise_seed`` is None."""
    import torch
    from safetensors.torch import load_file

    sd = load_file(str(tiny_model / "model.safetensors"))
    if noise_seed is not None:
        g = torch.Generator().manual_seed(noise_seed)
        sd = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in sd.items()}
    sd.pop("lm_head.weight", None)
    return sd


async def load(engine, state: dict, version: int) -> None:
    await WeightUpdates("contract", False, lambda v: None).load_state_dict(
        engine, "wait", state, version
    )


def sampling(**kw) -> Sampling:
    return Sampling(**{"n": 3, "temperature": 1.5, "max_tokens": 5, "seed": 7, **kw})


async def test_generate_returns_n_samples_of_per_token_arrays(engine):
    out = await engine.generate(PROMPT, sampling(), "contract-shape", version_salt(engine.version))
    assert out.prompt_ids and all(isinstance(t, int) for t in out.prompt_ids)
    assert sorted(c.index for c in out.completions) == [0, 1, 2]
    for c in out.completions:
        assert c.token_ids.dtype == np.int32 and c.versions.dtype == np.int32
        assert c.logprobs.dtype == np.float32
        assert len(c.token_ids) == len(c.logprobs) == len(c.versions) >= 1
        assert np.isfinite(c.logprobs).all() and (c.logprobs <= 0).all()
        assert (c.versions == engine.version).all()
        # the requested number of tokens, unless the model ended the sample itself
        assert len(c.token_ids) == 5 if c.finish_reason == "length" else c.finish_reason == "stop"
    # a prompt given as token ids is the same request
    again = await engine.generate(out.prompt_ids, sampling(), "contract-ids")
    assert [c.token_ids.tolist() for c in again.completions] == [
        c.token_ids.tolist() for c in out.completions
    ]


async def test_text_requests_return_text_and_no_logprobs(engine):
    out = await engine.generate(PROMPT, Sampling(2, 1.0, 4, seed=1, logprobs=False), "contract-t")
    assert len(out.completions) == 2
    for c in out.completions:
        assert c.logprobs is None and isinstance(c.text, str)
        text = engine.get_tokenizer().decode(c.token_ids.tolist(), skip_special_tokens=True)
        assert c.text == text


async def test_a_seed_reproduces_its_samples(engine):
    a = await engine.generate(PROMPT, sampling(), "contract-s1")
    b = await engine.generate(PROMPT, sampling(), "contract-s2")
    for x, y in zip(a.completions, b.completions):
        assert x.token_ids.tolist() == y.token_ids.tolist()
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)


async def test_seeded_prompts_longer_than_one_step_all_answer(engine):
    """64 seeded prompts of 35 tokens at once: 2,240 prompt tokens, more than one step of
    vLLM's default budget on a CPU (2,048), so one prompt would be cut over two steps,
    which a seeded request on a CPU generator cannot survive (asyncrl/engine/vllm_engine.py
    ``engine_kwargs``)."""
    prompts = [f"{i:02d}" + "1234567890" * 3 + "+7=" for i in range(64)]
    outs = await asyncio.gather(
        *(
            engine.generate(p, sampling(n=1, seed=i), f"contract-long-{i}")
            for i, p in enumerate(prompts)
        )
    )
    for out in outs:
        assert not out.aborted and len(out.prompt_ids) >= 35
        assert len(out.completions) == 1 and len(out.completions[0].token_ids) >= 1


@pytest.mark.parametrize("mode", ["keep", "abort"])
async def test_a_paused_engine_holds_requests_until_resumed(engine, mode):
    await engine.pause(mode)
    try:
        task = asyncio.ensure_future(engine.generate(PROMPT, sampling(n=1), f"contract-p-{mode}"))
        await asyncio.sleep(HELD_S)
        assert not task.done()
    finally:
        await engine.resume()
    out = await asyncio.wait_for(task, 60)
    assert len(out.completions) == 1 and not out.aborted


async def test_a_weight_update_changes_samples_and_labels_them(engine, tiny_model):
    start = engine.version
    before = await engine.generate(PROMPT, sampling(), "contract-w0")
    await load(engine, model_state(tiny_model, noise_seed=3), start + 1)
    try:
        assert engine.version == start + 1
        after = await engine.generate(PROMPT, sampling(), "contract-w1")
        for c in after.completions:
            assert (c.versions == start + 1).all()
        changed = [
            x.token_ids.tolist() != y.token_ids.tolist()
            or not np.allclose(x.logprobs, y.logprobs, atol=1e-3)
            for x, y in zip(before.completions, after.completions)
        ]
        assert any(changed)
    finally:  # the model's own weights back for the tests that share this engine: as
        # version 0 again if that is where it started (the engine as started), else anew
        restored = 0 if start == 0 else start + 2
        await load(engine, model_state(tiny_model, None), restored)
    back = await engine.generate(PROMPT, sampling(), "contract-w2")
    assert (back.completions[0].versions == restored).all()


async def test_errored_after_shutdown(engine, request):
    """Last: it shuts the engine down (for vLLM, only when no later test of the session
    needs the shared engine; conftest.py shuts it down after that test anyway)."""
    from conftest import last_engine_user

    from asyncrl.engine.sglang_engine import SGLangEngine

    if isinstance(engine, FakeEngine | SGLangEngine):
        pass
    elif last_engine_user(request.config, "vllm_actor") is not request.node:
        pytest.skip("a later test of this session uses the shared vLLM engine")
    assert not engine.errored
    engine.shutdown()
    assert engine.errored
