"""Learner throughput against plain PyTorch on the same tokens.

    python benchmarks/learner.py --quick            # one model, one rank, < 2 minutes
    python benchmarks/learner.py --quick --model small --world-size 2 --tp 2   # TP2 ranks
    python benchmarks/learner.py --out DIR          # sweep model size x world size: CSV + PNG

Batches look like the default run's: 16 groups x 8 samples of the addition task
(``AdditionTask(max_operand=19)``: prompts like ``13+7=``, a 1-2 digit answer + eos,
character tokens). Both sides start from the same random Qwen2 weights and see the
same trajectories:

* learner:  ``Learner.step_on_batch`` (collate, advantages, packing, loss object with
  its diagnostics, clipping, AdamW, update norm): what a training step costs;
* baseline: collate to a right-padded batch, one HF forward with the attention mask,
  log-softmax, a REINFORCE loss, backward, AdamW: the least a step can cost.

Steps alternate between the two (so load changes on a shared machine hit both) and
the fastest step counts (interference from other processes only ever adds time).
tokens/s = real (prompt + response) tokens / step time; ``cpu_ratio`` compares the
CPU seconds the two spent (one rank only), which other processes cannot inflate. The
last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# run as a script, this folder leads sys.path, and a sibling benchmark module named like
# a stdlib one (queue.py) would shadow it inside torch: put the repository there instead
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from asyncrl.learner.batch import collate  # noqa: E402
from asyncrl.learner.config import LearnerSettings  # noqa: E402
from asyncrl.learner.learner import Learner  # noqa: E402
from asyncrl.losses.advantages import GroupNormalized  # noqa: E402
from asyncrl.losses.clipped import ClippedISLoss  # noqa: E402
from asyncrl.models.tiny import random_qwen2  # noqa: E402
from asyncrl.tasks.arithmetic import AdditionTask  # noqa: E402
from asyncrl.trajectory import Trajectory  # noqa: E402

GROUPS, SAMPLES = 16, 8  # the default run's batch: learner.batch_groups x actor.sampling.n
VOCAB = ["<pad>", "<bos>", "<eos>", *sorted(set("0123456789+="))]  # the tiny model's tokens
EOS = 2
# name -> (hidden, layers, heads, kv heads, intermediate); head_dim 32 as vLLM-CPU needs
MODELS = {
    "tiny": (64, 2, 2, 1, 192),
    "small": (128, 2, 4, 2, 384),
    "medium": (256, 4, 8, 4, 768),
    "large": (512, 6, 16, 8, 1536),
}
QUICK_MODEL = "medium"
SWEEP_MODELS = ["small", "medium", "large"]
SWEEP_WORLD_SIZES = (1, 2)


def make_model(name: str, out: Path) -> Path:
    h, layers, heads, kv, inter = MODELS[name]
    random_qwen2(
        len(VOCAB),
        h,
        layers,
        heads,
        kv,
        inter,
        out_dir=out / name,
        pad_token_id=0,
        eos_token_id=EOS,
    )
    return out / name


def make_batch(seed: int) -> list[Trajectory]:
    """One default-sized batch of addition-task trajectories (answers right or off by one)."""
    task, rng, nrng = AdditionTask(max_operand=19), random.Random(seed), np.random.default_rng(seed)
    tok = {c: i for i, c in enumerate(VOCAB)}
    out = []
    for g in range(GROUPS):
        p = task.sample(rng)
        prompt = [tok[c] for c in p.text]
        for s in range(SAMPLES):
            answer = p.answer if rng.random() < 0.5 else str(int(p.answer) + 1)
            resp = [tok[c] for c in answer] + [EOS]
            out.append(
                Trajectory(
                    f"{seed}-{g}-{s}",
                    f"{seed}-{g}",
                    prompt,
                    resp,
                    -nrng.random(len(resp)).astype(np.float32),
                    np.zeros(len(resp), np.int32),
                    np.ones(len(resp), bool),
                    float(answer == p.answer),
                )  # fmt: skip
            )
    return out


class Baseline:
    """Plain PyTorch: padded batch, full forward, REINFORCE loss, backward, AdamW."""

    def __init__(self, model_dir: Path, lr: float):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def step(self, trajs: list[Trajectory]) -> None:
        b = collate(trajs)
        logits = self.model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
        T = b.response_ids.shape[1]
        pos = (b.resp_start[:, None] + torch.arange(T)[None] - 1).clamp(0, b.input_ids.shape[1] - 1)
        logp = logits.log_softmax(-1).gather(1, pos[:, :, None].expand(-1, -1, logits.shape[-1]))
        logp = logp.gather(-1, b.response_ids[:, :, None]).squeeze(-1)
        adv = (b.rewards - b.rewards.mean())[:, None]
        loss = -(adv * logp * b.mask).sum() / b.mask.sum()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def real_tokens(trajs: list[Trajectory]) -> int:
    return sum(t.num_tokens for t in trajs)


def measure(model_dir: Path, steps: int, threads: int, world_size: int = 1, tp: int = 1) -> dict:
    """Best step time of the learner (``world_size`` ranks, ``tp`` of them per tensor-
    parallel group) and of the baseline."""
    torch.set_num_threads(threads)
    optim = {"lr": 1e-4}  # the baseline's; the rest as asyncrl-train's
    group = None
    if world_size == 1:
        learner = Learner(
            str(model_dir), ClippedISLoss(), GroupNormalized(),
            LearnerSettings.defaults(optim=optim, num_threads=threads),
        )  # fmt: skip
        step = learner.step_on_batch
    else:
        from asyncrl.learner.group import LearnerGroup

        group = LearnerGroup(
            str(model_dir), ClippedISLoss(), GroupNormalized(),
            LearnerSettings.defaults(
                optim=optim, world_size=world_size, tp=tp, num_threads=threads
            ),
        )  # fmt: skip
        group.ping()
        step = group.step_on_batch
    base = Baseline(model_dir, 1e-4)
    t_learner, t_base, cpu_l, cpu_b, eff, pad_eff, secs = [], [], [], [], [], [], []
    try:
        for i in range(steps + 1):  # step 0 warms up (allocator, lazy init) and is dropped
            trajs = make_batch(seed=i)
            n = real_tokens(trajs)
            c0, t0 = time.thread_time(), time.perf_counter()
            m = step(collate(trajs), i)
            c1, t1 = time.thread_time(), time.perf_counter()
            base.step(trajs)
            c2, t2 = time.thread_time(), time.perf_counter()
            if i:
                t_learner.append(n / (t1 - t0))
                secs.append(t1 - t0)
                t_base.append(n / (t2 - t1))
                cpu_l.append(c1 - c0)
                cpu_b.append(c2 - c1)
                eff.append(m["perf/packing_efficiency"])
                lengths = [t.num_tokens for t in trajs]
                pad_eff.append(sum(lengths) / (len(lengths) * max(lengths)))
    finally:
        if group is not None:
            group.close()
    tps, btps = max(t_learner), max(t_base)
    return {
        "tokens_per_s": round(tps, 1),
        "seconds_per_step": round(min(secs), 4),  # the fastest step (its batch varies)
        "baseline_tokens_per_s": round(btps, 1),
        "ratio": round(tps / btps, 3),
        # CPU seconds of this thread (one rank, one torch thread: all of the work): immune
        # to other processes' load, so steadier than the wall-clock ratio on a shared box
        "cpu_ratio": round(sum(cpu_b) / sum(cpu_l), 3) if world_size == 1 else None,
        "packing_efficiency": round(statistics.mean(eff), 4),
        "padded_efficiency": round(statistics.mean(pad_eff), 4),
        "tokens_per_step": real_tokens(make_batch(0)),
    }


def table(rows: list[dict], keys: list[str]) -> str:
    widths = [max(len(k), *(len(str(r[k])) for r in rows)) for k in keys]
    line = lambda vals: "  ".join(str(v).rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    body = [line(r[k] for k in keys) for r in rows]
    return "\n".join([line(keys), line("-" * w for w in widths), *body])


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    models = list(dict.fromkeys(r["model"] for r in rows))
    x = np.arange(len(models))
    for k, ws in enumerate(sorted({r["world_size"] for r in rows})):
        at = {r["model"]: r["tokens_per_s"] for r in rows if r["world_size"] == ws}
        ys = [at.get(m, 0.0) for m in models]
        ax.bar(x + 0.25 * k, ys, width=0.25, label=f"learner, {ws} rank(s)")
    base = [next(r["baseline_tokens_per_s"] for r in rows if r["model"] == m) for m in models]
    ax.plot(x + 0.125, base, "k_", markersize=30, mew=2, label="plain PyTorch, 1 process")
    ax.set_xticks(x + 0.125, models)
    ax.set_yscale("log")
    ax.set_ylabel("trained tokens / s (log)")
    ax.set_title("learner throughput (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"one model ({QUICK_MODEL}), one rank")
    ap.add_argument("--model", default=None, choices=list(MODELS), help="model for --quick")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per setting")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--world-size", type=int, default=1, help="learner ranks for --quick")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks for --quick")
    ap.add_argument("--out", type=Path, default=ROOT / "bench_out" / "learner")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-") as tmp:
        if args.quick:
            name = args.model or QUICK_MODEL
            ws, tp = args.world_size, args.tp
            if ws > 1:
                import ray

                ray.init(_node_ip_address="127.0.0.2", include_dashboard=False, num_cpus=ws)
            try:
                res = measure(make_model(name, Path(tmp)), args.steps or 6, args.threads, ws, tp)
            finally:
                if ws > 1:
                    ray.shutdown()
            rows = [{"model": name, "world_size": ws, "tp": tp, "threads": args.threads, **res}]
        else:
            rows = sweep(Path(tmp), args.steps or 6, args.threads)
    keys = ["model", "world_size", "tp", "threads", "tokens_per_s", "seconds_per_step",
            "baseline_tokens_per_s", "ratio", "cpu_ratio", "packing_efficiency",
            "padded_efficiency"]  # fmt: skip
    print(table(rows, keys))
    if not args.quick:
        from benchmarks.common import run_fingerprint, write_csv

        write_csv(args.out / "learner.csv", rows, fingerprint=run_fingerprint())
        plot(rows, args.out / "learner.png")
        print(f"wrote {args.out / 'learner.csv'} and {args.out / 'learner.png'}")
    summary = rows[0] if args.quick else {**rows[0], "sweep": rows}
    print(json.dumps(summary))
    return summary


def sweep(tmp: Path, steps: int, threads: int) -> list[dict]:
    """One rank first (no Ray running to steal cycles), then the multi-rank groups."""
    import ray

    paths = {name: make_model(name, tmp) for name in SWEEP_MODELS}
    rows = []
    for ws in SWEEP_WORLD_SIZES:
        if ws > 1 and not ray.is_initialized():
            ray.init(_node_ip_address="127.0.0.2", include_dashboard=False, num_cpus=ws)
        for name, path in paths.items():
            res = measure(path, steps, threads, world_size=ws)
            rows.append({"model": name, "world_size": ws, "tp": 1, "threads": threads, **res})
            print(rows[-1], file=sys.stderr)
    if ray.is_initialized():
        ray.shutdown()
    return sorted(rows, key=lambda r: (SWEEP_MODELS.index(r["model"]), r["world_size"]))


if __name__ == "__main__":
    main()
