"""GPU check of the learner (no vLLM, no Ray): FSDP2 on CUDA with an NCCL group of
one, bf16 mixed precision, sequence packing, weight streaming.

    1. a few optimizer steps on a random 4-layer Qwen2 (bf16 compute, fp32 master
       weights): loss and grad norm finite, parameters move, tokens/s
    2. log-probs on packed rows vs one sequence at a time (bf16 tolerance)
    3. named_parameters_stream(): HF names and full shapes, layer by layer, and GB/s of
       the stream copied out to the CPU (what the broker sends from)

``--size tiny`` (default) is the 4-layer model; ``--size 0.5b`` is Qwen2-0.5B's shape
(random weights, built here: no download) on 64-768-token responses, for tokens/s at a
real size; ``--minibatches N`` takes N optimizer steps per batch. tokens/s leaves out
the first step (CUDA's lazy set-up); ``model_tflops`` is 6 x parameters x tokens per
second, an estimate of the work done.

Prints one line per check and, last, one JSON line. Exit status 1 if a check failed.
``--dry-run-on-cpu`` runs the same code on the CPU (unsharded, and ``0.5b`` cut to two
layers, a small vocabulary and a quarter of the lengths) to catch mistakes first.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

_p = argparse.ArgumentParser(description="GPU check of the learner (see the docstring)")
_p.add_argument("--dry-run-on-cpu", action="store_true", help="the same code on the CPU")
_p.add_argument("--size", default="tiny", help="tiny | 0.5b")
_p.add_argument("--minibatches", type=int, default=1, help="learner.minibatches (steps per batch)")
ARGS = _p.parse_args()
DRY, SIZE = ARGS.dry_run_on_cpu, ARGS.size
BF16_LOGP_TOL = 0.1  # packed vs single rows differ only in bf16 kernel order
# model: random_qwen2(vocab, hidden, layers, heads, kv_heads, intermediate, max_positions);
# batch: trajectories per step, prompt and response lengths [lo, hi), micro-batch tokens
SIZES = {
    "tiny": dict(model=(64, 256, 4, 4, 2, 512, 256), n=64, prompt=(4, 20), response=(2, 40),
                 micro=2048, steps=5),
    "0.5b": dict(model=(151936, 896, 24, 14, 2, 4864, 2048), n=32, prompt=(64, 256),
                 response=(64, 768), micro=8192, steps=4),
}  # fmt: skip
if SIZE not in SIZES:
    sys.exit(f"--size must be one of {sorted(SIZES)}, got {SIZE!r}")
SPEC = SIZES[SIZE]
if DRY and SIZE != "tiny":  # the same code on the CPU in seconds: two layers, small
    # vocabulary, a quarter of the lengths
    v, h, _, nh, kv, i, mp = SPEC["model"]
    quarter = {k: tuple(x // 4 for x in SPEC[k]) for k in ("prompt", "response")}
    SPEC = {**SPEC, "model": (4096, h, 2, nh, kv, i, mp), "n": 4, "steps": 2, **quarter}


def build_model(d: Path) -> Path:
    from asyncrl.models.tiny import random_qwen2

    *shape, max_positions = SPEC["model"]
    random_qwen2(*shape, max_positions=max_positions, out_dir=d, pad_token_id=0)
    return d


def trajs(n: int, seed: int):
    from asyncrl.trajectory import Trajectory

    rng = np.random.default_rng(seed)
    vocab = SPEC["model"][0]
    out = []
    for i in range(n):
        p, r = int(rng.integers(*SPEC["prompt"])), int(rng.integers(*SPEC["response"]))
        out.append(
            Trajectory(
                f"t{i}",
                f"g{i // 8}",
                rng.integers(1, vocab, p),
                rng.integers(1, vocab, r),
                -rng.random(r).astype(np.float32) * 4,
                np.zeros(r, np.int32),
                np.ones(r, bool),
                float(rng.random() < 0.5),
            )
        )
    return out


def sync() -> None:
    if not DRY:
        torch.cuda.synchronize()


def make_learner(path: Path):
    from asyncrl.learner.config import LearnerSettings
    from asyncrl.learner.learner import Learner
    from asyncrl.losses.advantages import GroupNormalized
    from asyncrl.losses.clipped import ClippedISLoss
    from asyncrl.transport.group import free_port

    settings = LearnerSettings.defaults(
        optim={"lr": 1e-4}, micro_batch_tokens=SPEC["micro"], minibatches=ARGS.minibatches
    )
    rdv = None if DRY else f"127.0.0.1:{free_port()}"
    return Learner(str(path), ClippedISLoss(), GroupNormalized(), settings, rank=0, rendezvous=rdv)


def check_steps(L, figures: dict) -> tuple[bool, dict, dict]:
    """``SPEC["steps"]`` optimizer steps (the first one timed apart); whether they ran
    clean and moved the weights, and the weights before and after."""
    from asyncrl.learner.batch import collate

    before = {n: p.detach().float().clone().cpu() for n, p in L.named_parameters_stream()}
    n_params = sum(t.numel() for t in before.values())
    figures["params"] = n_params
    ok = True
    tokens, seconds = 0, 0.0
    for step in range(SPEC["steps"]):
        batch = collate(trajs(SPEC["n"], step), L.pad_id)
        sync()
        t0 = time.perf_counter()
        m = L.step_on_batch(batch, L.version)
        sync()
        if step == 0:
            figures["first_step_s"] = round(time.perf_counter() - t0, 3)
        else:
            seconds += time.perf_counter() - t0
            tokens += int(batch.attention_mask.sum())
        ok &= bool(np.isfinite(m["loss/total"]) and np.isfinite(m["learner/grad_norm"]))
        ok &= m["learner/optimizer_steps"] == ARGS.minibatches
    figures["tokens_per_s"] = round(tokens / seconds, 1)
    figures["model_tflops"] = round(6 * n_params * tokens / seconds / 1e12, 2)
    # The stream's tensors are valid only until the next item (FSDP reshards the
    # unit behind it), so copy each one out before moving on.
    after = {n: t.detach().float().clone().cpu() for n, t in L.named_parameters_stream()}
    moved = max(float((after[n] - before[n]).abs().max()) for n in before)
    figures["moved"] = moved
    return ok and moved > 0, before, after


def check_outputs(L, before: dict, after: dict, figures: dict) -> list[tuple[str, bool, str]]:
    """The weight stream's speed, names and shapes, and packed vs per-sequence log-probs."""
    sync()
    t0 = time.perf_counter()
    nbytes = sum(t.numel() * t.element_size() for _, t in L.stream_weights())
    figures["stream_to_cpu_gbps"] = round(nbytes / (time.perf_counter() - t0) / 1e9, 2)
    ts = trajs(16, 99)
    packed = L.logprobs_of(ts)
    single = [L.logprobs_of([t])[0] for t in ts]
    diff = max(float(np.abs(a - b).max()) for a, b in zip(packed, single))
    figures["packed_vs_single_max_abs"] = diff
    names = list(after)
    shapes_ok = (
        all(after[n].shape == before[n].shape for n in names)
        and "model.embed_tokens.weight" in names
    )
    return [
        ("packed == per-sequence log-probs", diff < BF16_LOGP_TOL, f"max |d| {diff:.3g}"),
        (
            "weight stream: HF names, full shapes",
            shapes_ok and names == list(before) and len(names) > 0,
            f"{len(names)} tensors; to the CPU {figures['stream_to_cpu_gbps']} GB/s",
        ),
    ]


def main() -> int:
    figures = {"device": "cpu" if DRY else torch.cuda.get_device_name(0), "size": SIZE}
    figures["minibatches"] = ARGS.minibatches
    if not DRY and not torch.cuda.is_available():
        print("no CUDA: nothing to check (use --dry-run-on-cpu)")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        L = make_learner(build_model(Path(tmp)))
        figures["sharded"] = bool(L.sharded)
        ok_step, before, after = check_steps(L, figures)
        moved = figures.pop("moved")
        results = [
            (
                "fsdp steps (bf16, nccl x1)",
                ok_step,
                f"moved {moved:.2e}, {figures['tokens_per_s']} tok/s "
                f"({figures['model_tflops']} TFLOP/s by 6N; first step {figures['first_step_s']}s)",
            )
        ]
        results += check_outputs(L, before, after, figures)
    for name, passed, detail in results:
        print(f"{'PASS' if passed else 'FAIL'}  {name}: {detail}")
    figures["passed"] = all(p for _, p, _ in results)
    print(json.dumps(figures))
    return 0 if figures["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
