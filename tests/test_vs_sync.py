"""benchmarks/vs_sync.py: the sync loop's batch is well formed (the learner's own data
contract), and the script runs end to end on a tiny budget with its JSON keys, sane and
consistent values (never speed targets: those live in the script's output)."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is not an installed package
    sys.path.insert(0, str(ROOT))

KEYS = {"asyncrl_seconds_per_step", "sync_seconds_per_step", "ratio", "asyncrl_total_seconds",
        "sync_total_seconds", "total_ratio", "asyncrl_reward_last", "sync_reward_last",
        "startup_seconds"}  # fmt: skip


@pytest.mark.parametrize("bf16", [False, True])
def test_sync_loop_batch_follows_the_trajectory_contract(bf16):
    """HF generate's batch: n completions per prompt, each ending at EOS or max_tokens,
    behaviour log-probs equal to the model's own processed log-probs of those tokens
    (recomputed independently here, in fp32), rewards the task's. Under bf16 autocast (an
    engine at actor.engine.dtype=bfloat16) the log-probs are the fp32 ones to bf16's
    precision, and really differ from them."""
    import torch

    from asyncrl.engine.settings import SamplingSettings
    from asyncrl.learner.batch import collate
    from asyncrl.learner.logprobs import response_logprobs
    from asyncrl.tasks.arithmetic import AdditionTask
    from asyncrl.tasks.base import TaskSampler
    from asyncrl.wiring import prepare
    from benchmarks.common import compose
    from benchmarks.vs_sync import _tokenizer, generate_batch

    setup = prepare(compose("max_steps=1"))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(setup.model_path)
    tok = _tokenizer(setup.model_path)
    task = AdditionTask(max_operand=19)
    sampler = TaskSampler(task, 0)
    prompts = [sampler.next() for _ in range(3)]
    sampling = SamplingSettings.defaults(n=4, temperature=0.7, max_tokens=6)
    torch.manual_seed(0)
    trajs = generate_batch(model, tok, task, prompts, sampling, version=5, bf16=bf16)
    assert len(trajs) == 12
    for i, t in enumerate(trajs):
        p = prompts[i // 4]
        assert t.prompt_text == p.text
        assert list(t.prompt_ids) == tok(p.text)["input_ids"]
        assert 1 <= len(t.response_ids) <= 6
        ends = int(t.response_ids[-1]) == tok.eos_token_id
        assert ends or len(t.response_ids) == 6
        assert tok.eos_token_id not in t.response_ids[:-1].tolist()
        assert set(t.versions.tolist()) == {5} and t.loss_mask.all()
        want = task.reward(p, tok.decode(t.response_ids.tolist(), skip_special_tokens=True))
        assert t.reward == pytest.approx(float(want["reward"] if isinstance(want, dict) else want))
        assert (t.behaviour_logprobs <= 0).all()
    batch = collate(trajs, tok.pad_token_id)
    with torch.no_grad():
        ref = response_logprobs(model, batch, temperature=0.7)
    got, want = batch.behaviour_logprobs[batch.mask], ref[batch.mask]
    assert torch.allclose(want, got, atol=0.05 if bf16 else 1e-4)
    assert bf16 == (not torch.allclose(want, got, atol=1e-4))


@pytest.mark.slow
def test_vs_sync_smoke(tmp_path):
    """Both sides, 4 steps, one seed: the JSON's keys, finite and consistent values."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.vs_sync", "--out", str(tmp_path), "--steps", "4",
         "--seeds", "0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    f = json.loads([x for x in r.stdout.splitlines() if x.strip()][-1])
    assert KEYS <= set(f) and f.pop("job") == "default"
    assert all(isinstance(v, int | float) and math.isfinite(v) for v in f.values()), f
    # where each side's time went: the sync loop's phases add up to its step
    parts = ("generate", "env_wait", "train")
    assert sum(f[f"sync_{p}_seconds_per_step"] for p in parts) == pytest.approx(
        f["sync_seconds_per_step"], rel=0.5)  # fmt: skip
    assert f["sync_env_wait_seconds_per_step"] == 0  # single-turn: scored inline
    assert f["asyncrl_train_seconds_per_step"] > 0
    for side in ("asyncrl", "sync"):
        assert f[f"{side}_seconds_per_step"] > 0
        assert 0 <= f[f"{side}_reward_last"] <= 1
        # a whole run outlasts its steps
        assert f[f"{side}_total_seconds"] > 3 * f[f"{side}_seconds_per_step"]
    assert f["ratio"] == pytest.approx(f["sync_seconds_per_step"] / f["asyncrl_seconds_per_step"])
    assert f["total_ratio"] == pytest.approx(f["sync_total_seconds"] / f["asyncrl_total_seconds"])
    assert 0 < f["startup_seconds"] < f["asyncrl_total_seconds"]
    rows = list(csv.DictReader((tmp_path / "vs_sync.csv").open()))
    assert sorted(r["side"] for r in rows) == ["asyncrl", "sync"]
    assert all(int(r["steps"]) == 4 and r["fp_git_commit"] for r in rows)
    summary = json.loads((tmp_path / "seed0" / "asyncrl" / "summary.json").read_text())
    assert summary["startup_seconds"] == pytest.approx(f["startup_seconds"])
    assert (tmp_path / "vs_sync.png").stat().st_size > 0
