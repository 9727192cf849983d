"""The reward model served on a Ray actor (asyncrl/rewards/rm.py): dynamic batching,
scores equal to an in-process forward pass, and bad model directories refused."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from asyncrl.config import ConfigError
from asyncrl.rewards.base import RewardInput
from asyncrl.rewards.serving import DynamicBatcher


def _inputs(pairs: list[tuple[str, str]]) -> list[RewardInput]:
    return [RewardInput(p, r, [], None, {}, 0.0) for p, r in pairs]


def test_batcher_coalesces_and_caps():
    """Concurrent callers share passes; no pass exceeds max_batch; each caller gets its
    own results back in order."""

    async def run(items):
        await asyncio.sleep(0.01)
        return [x * 10 for x in items]

    async def main(max_batch):
        b = DynamicBatcher(run, max_batch=max_batch, max_wait_ms=500)
        calls = [list(range(i * 3, i * 3 + 3)) for i in range(4)]
        outs = await asyncio.gather(*(b.submit(c) for c in calls))
        return outs, b.stats()

    outs, stats = asyncio.run(main(64))
    assert outs == [[x * 10 for x in range(i * 3, i * 3 + 3)] for i in range(4)]
    assert stats == {"passes": 1, "sizes": [12]}
    outs, stats = asyncio.run(main(5))
    assert outs[3] == [90, 100, 110]
    assert stats == {"passes": 3, "sizes": [5, 5, 2]}


def test_batcher_error_reaches_every_caller_of_the_pass():
    async def run(items):
        raise RuntimeError("boom")

    async def main():
        b = DynamicBatcher(run, max_batch=8, max_wait_ms=50)
        return await asyncio.gather(b.submit([1]), b.submit([2]), return_exceptions=True)

    assert [str(e) for e in asyncio.run(main())] == ["boom", "boom"]


def test_bad_model_directories_are_refused(tmp_path, tiny_model):
    from asyncrl.rewards.rm import RewardModel
    from asyncrl.rewards.tiny_rm import ensure_tiny_rm

    with pytest.raises(ConfigError, match=r"model=.*nope: no such directory"):
        RewardModel(model=str(tmp_path / "nope"))
    # the tiny policy is a causal LM, not a sequence classifier
    with pytest.raises(ConfigError, match="no \\*ForSequenceClassification"):
        RewardModel(model=str(tiny_model))
    bad = tmp_path / "rm"
    shutil.copytree(ensure_tiny_rm(), bad)
    (bad / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no weights"):
        RewardModel(model=str(bad))
    conf = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**conf, "id2label": {"0": "a", "1": "b"}}))
    with pytest.raises(ConfigError, match="2 labels"):
        RewardModel(model=str(bad))
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        RewardModel(model=str(bad))
    with pytest.raises(ConfigError, match="max_batch=0"):
        RewardModel(max_batch=0)


@pytest.mark.slow
def test_served_scores_batch_and_equal_in_process(ray_local):
    """Four concurrent score() calls of three episodes each: one forward pass of twelve
    on the actor; every score equals the model run on that text alone, in this process
    (so the padding of a mixed-length batch changes nothing)."""
    import ray
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from asyncrl.rewards.rm import RewardModel

    pairs = [(f"{a}+{b}=", str(a + b + (i % 2))) for i, (a, b) in enumerate(
        [(3, 4), (12, 19), (0, 0), (7, 15), (19, 19), (1, 2), (5, 5), (9, 1), (18, 3), (2, 2), (6, 13), (11, 0)]
    )]  # fmt: skip
    rm = RewardModel(model="tiny", max_batch=64, max_wait_ms=2000)

    async def main():
        chunks = [_inputs(pairs[i : i + 3]) for i in range(0, 12, 3)]
        return await asyncio.gather(*(rm.score(c) for c in chunks))

    try:
        outs = [o for chunk in asyncio.run(main()) for o in chunk]
        stats = ray.get(rm.server().stats.remote())
    finally:
        asyncio.run(rm.close())
    assert stats["passes"] == 1 and stats["sizes"] == [12] and stats["device"] == "cpu"

    tok = AutoTokenizer.from_pretrained(rm.model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm.model_dir, dtype=torch.float32)
    with torch.no_grad():
        want = [
            model(**tok(p + r, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item()
            for p, r in pairs
        ]
    got = [o.value for o in outs]
    assert all(o.error == "" for o in outs)
    assert got == pytest.approx(want, abs=1e-5)
    assert len(set(round(v, 4) for v in got)) > 1  # the model tells texts apart


def test_bad_model_dir_exits_2_before_ray(tmp_path):
    """reward=rm with a directory that is not a reward model: one line naming the key,
    exit 2, from the driver's start-up check (no Ray, no engine)."""
    import subprocess
    import sys
    from pathlib import Path

    r = subprocess.run(
        [sys.executable, "-m", "asyncrl.train", "reward=rm", "max_steps=1",
         f"reward.components.1.model={tmp_path}", f"hydra.run.dir={tmp_path / 'out'}"],
        cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
    assert lines == [
        f"asyncrl: config error: reward.components[1].model={tmp_path}: no config.json "
        "(not a Hugging Face model directory)"
    ]
