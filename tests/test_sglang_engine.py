"""SGLangEngine (asyncrl/engine/sglang_engine.py) beyond the shared contract
(tests/test_engine_contract.py): weight updates under each mode with requests in flight,
per-sample seeds, the ServerArgs it starts SGLang with, and the runs refused before Ray
starts with ``actor.engine.backend=sglang``. Against the fake of SGLang's Engine
(tests/fake_sglang.py): SGLang cannot run here (docs/engines.md)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from fake_sglang import installed
from helpers import composed, refused_before_ray
from test_engine_contract import model_state

from asyncrl.actor.weights import WeightUpdates
from asyncrl.engine import sglang_engine
from asyncrl.engine.backend import make_engine
from asyncrl.engine.protocol import Sampling
from asyncrl.engine.settings import EngineSettings

ASYNC = pytest.mark.asyncio(loop_scope="session")

PROMPT = "3+4="


@pytest.fixture
def start(tiny_model):
    """``start(**engine settings)``: an SGLangEngine on the fake, shut down afterwards."""
    engines = []
    with installed():

        def start(**kw):
            s = EngineSettings.defaults(backend="sglang", **kw)
            engines.append(make_engine(str(tiny_model), s, 0))
            return engines[-1]

        yield start
        for e in engines:
            e.shutdown()


async def tokens_out(engine, k: int) -> None:
    """Until the engine's one running request has sampled ``k`` tokens."""
    sched = engine.eng.tokenizer_manager.scheduler
    deadline = asyncio.get_running_loop().time() + 30
    while not (sched.running and len(sched.running[0].output_ids) >= k):
        if sched.task is not None and sched.task.done():
            sched.task.result()  # the fake's scheduler failed: its error
        assert asyncio.get_running_loop().time() < deadline, "no tokens within 30 s"
        await asyncio.sleep(0.001)


@ASYNC
@pytest.mark.parametrize("prefix_caching", [False, True])
async def test_keep_continues_a_request_on_the_new_weights(start, tiny_model, prefix_caching):
    """Under ``keep`` a request in flight survives the update (SGLang's ``in_place``, or
    ``retract`` with the radix cache on, whose flush then succeeds) and its tokens carry
    the version that sampled each."""
    engine = start(enable_prefix_caching=prefix_caching)
    await engine.label(1)
    task = asyncio.ensure_future(
        engine.generate(PROMPT, Sampling(1, 1.0, 12, seed=3, min_tokens=12), "k")
    )
    await tokens_out(engine, 3)
    updates = WeightUpdates("t", prefix_caching, lambda v: None)
    await updates.load_state_dict(engine, "keep", model_state(tiny_model, 5), 2)
    (c,) = (await asyncio.wait_for(task, 60)).completions
    assert c.finish_reason == "length" and len(c.token_ids) == 12
    cut = int(np.argmax(c.versions == 2))
    assert cut >= 3 and (c.versions[:cut] == 1).all() and (c.versions[cut:] == 2).all()


@ASYNC
@pytest.mark.parametrize("mode", ["abort", "wait"])
async def test_abort_cuts_a_request_short_and_wait_lets_it_finish(start, tiny_model, mode):
    engine = start()
    task = asyncio.ensure_future(
        engine.generate(PROMPT, Sampling(1, 1.0, 12, seed=3, min_tokens=12), mode)
    )
    await tokens_out(engine, 2)
    await WeightUpdates("t", False, lambda v: None).load_state_dict(
        engine, mode, model_state(tiny_model, 5), 1
    )
    (c,) = (await asyncio.wait_for(task, 60)).completions
    if mode == "abort":
        assert c.finish_reason == "abort" and 2 <= len(c.token_ids) < 12
    else:  # finished on the old weights before the load
        assert c.finish_reason == "length" and (c.versions == 0).all()
    after = await engine.generate(PROMPT, Sampling(1, 1.0, 4, seed=3), "after")
    assert (after.completions[0].versions == 1).all()


@ASYNC
async def test_sample_i_is_seeded_seed_plus_i(start):
    """SGLang gives every copy of an n > 1 request one seed; SGLangEngine sends each
    sample as a request seeded ``seed + i``, as vLLM seeds its samples."""
    engine = start()
    group = await engine.generate(PROMPT, Sampling(4, 1.5, 6, seed=11), "g")
    alone = [
        await engine.generate(PROMPT, Sampling(1, 1.5, 6, seed=11 + i), f"a{i}") for i in range(4)
    ]
    for i, c in enumerate(group.completions):
        assert c.token_ids.tolist() == alone[i].completions[0].token_ids.tolist()
    assert len({tuple(c.token_ids.tolist()) for c in group.completions}) > 1


@ASYNC
async def test_images_are_refused(start):
    with pytest.raises(ValueError, match="no images"):
        await start().generate(PROMPT, Sampling(), "img", images=[b"png"])


def test_server_args_follow_the_engine_settings():
    s = EngineSettings.defaults(
        backend="sglang",
        max_model_len=48,
        enable_prefix_caching=True,
        extra={"max_total_tokens": 512},
    )
    kw = sglang_engine.server_kwargs("/m", s, seed=7)
    assert kw["model_path"] == "/m" and kw["context_length"] == 48 and kw["random_seed"] == 7
    assert kw["disable_radix_cache"] is False and kw["max_total_tokens"] == 512
    assert kw["dtype"] == "float32" and kw["tp_size"] == 1


SGLANG = ("actor.engine.backend=sglang",)
REFUSED = [
    (SGLANG, "broker=gloo: the process-group broker's receivers are vLLM workers"),
    ((*SGLANG, "broker=objectstore", "actor.engine_cores=0"), "set actor.engine_cores=null"),
    ((*SGLANG, "broker=objectstore", "actor.sampling.top_p=0.9"), "set actor.sampling.top_p=1.0"),
    ((*SGLANG, "broker=objectstore", "actor.sampling.top_k=5"), "top_k=5"),
    ((*SGLANG, "broker=objectstore"), "this Python cannot import sglang"),
]


@pytest.mark.parametrize("overrides,names", REFUSED, ids=[o[-1] for o, _ in REFUSED])
def test_what_sglang_cannot_serve_is_refused_before_ray(
    overrides, names, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(sglang_engine, "importable", lambda: False)  # as on this host
    line = refused_before_ray(composed(*overrides), tmp_path, capsys, monkeypatch)
    assert "actor.engine.backend=sglang" in line and names in line


def test_recorded_experts_are_refused_with_sglang():
    """(A dense model's run asking for routes is refused earlier, for the model.)"""
    from asyncrl.actor.settings import ActorSettings
    from asyncrl.broker.settings import BrokerSettings
    from asyncrl.config import ConfigError
    from asyncrl.wiring import check_engine_backend

    actor = ActorSettings.defaults(engine={"backend": "sglang"}, record_experts=True)
    with pytest.raises(ConfigError, match="actor.record_experts=true"):
        check_engine_backend(actor, BrokerSettings.defaults(kind="objectstore"))


def test_an_importable_sglang_on_the_object_store_broker_passes(monkeypatch):
    from asyncrl.wiring import prepare

    monkeypatch.setattr(sglang_engine, "importable", lambda: True)
    setup = prepare(composed(*SGLANG, "broker=objectstore"))
    assert setup.actor.engine.backend == "sglang"
