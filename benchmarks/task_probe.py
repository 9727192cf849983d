"""Where does a pretrained model start on reasoning-gym datasets, with and without worked
examples? Greedy and sampled answers on held-out prompts, scored by each dataset's own
scorer: the signal an RL run (``benchmarks/learn.py``) would start from.

    per dataset, per shot count:  task=reasoning_gym task.dataset=<name> task.shots=<k>
                  (the model's chat template; ``k`` worked examples as chat turns)
                  ─▶ each held-out prompt: 1 greedy answer and --samples at --temperature,
                     on one engine (prompts are text; the shot counts differ in text only)
                  ─▶ greedy / sampled exact share (score 1), mean score, groups whose
                     scores differ (what a group-relative advantage can learn from), and
                     ``constant``: the commonest answer's share, what always giving it
                     scores

The prompts are the held-out split ``benchmarks/learn.py`` evaluates (its heldout_frac,
set seed 1). The last stdout line is one JSON object: ``by_dataset`` (dataset ->
shots -> figures), ``model``, the host.

    python -m benchmarks.task_probe                                 # SmolLM2, bf16
    python -m benchmarks.task_probe --datasets products --shots 0 3 --prompts 16
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: see the note in benchmarks/common.py
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import asyncio  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.common import compose, emit_json, host, parser, print_table, probe_args  # noqa: E402

SYSTEM = "Reply with the answer only."
# --datasets: name -> task.config (small instances, so that a 135M model can get some right)
DATASETS: dict[str, str] = {
    "products": "{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}",
    "basic_arithmetic": "{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}",
    "chain_sum": "{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 2}",
    "gcd": "{min_numbers: 2, max_numbers: 2, min_value: 1, max_value: 30}",
    "letter_counting": "{min_words: 3, max_words: 5}",
    "number_sorting": "{min_numbers: 3, max_numbers: 3, min_decimals: 0, max_decimals: 0}",
    "word_sorting": "{min_words: 3, max_words: 3}",
    "spell_backward": "{min_word_len: 3, max_word_len: 4}",
    "leg_counting": "{min_animals: 1, max_animals: 2}",
    "count_bits": "{max_n: 64}",
}
# the worked examples and the system text make prompts of up to ~600 tokens (number_sorting's
# questions with three examples; model=smollm2 sizes its engine for ~40)
PROBE_OVERRIDES = ["actor.engine.max_model_len=1024", "actor.engine.kv_cache_memory_mb=512"]
HELDOUT_FRAC = 0.3  # benchmarks/learn.py's split
SET_SEED = 1  # its first set


def task_of(args: Any, dataset: str, shots: int):
    """The task (bound to the model) and its held-out prompts."""
    from asyncrl.eval.split import heldout_prompts
    from asyncrl.models.resolve import resolve_model
    from asyncrl.wiring import build_task

    cfg = compose(
        f"model={args.model}", "task=reasoning_gym", f"task.dataset={dataset}",
        f"+task.config={DATASETS[dataset]}", f"task.system='{SYSTEM}'", f"task.shots={shots}",
        f"actor.engine.dtype={args.dtype}", *PROBE_OVERRIDES, *args.overrides,
    )  # fmt: skip
    task = build_task(cfg)
    path = resolve_model(cfg, task)
    return cfg, task, str(path), heldout_prompts(task, HELDOUT_FRAC, SET_SEED, args.prompts)


async def probe(engine: Any, task: Any, prompts: list, args: Any) -> dict[str, Any]:
    from asyncrl.engine.protocol import text_sampling

    greedy = text_sampling(0.0, args.max_tokens)
    sampled = text_sampling(args.temperature, args.max_tokens, n=args.samples)
    t0 = time.time()
    runs = await asyncio.gather(
        *[engine.generate(p.text, greedy, f"g{i}") for i, p in enumerate(prompts)],
        *[engine.generate(p.text, sampled, f"s{i}") for i, p in enumerate(prompts)],
    )  # fmt: skip
    n = len(prompts)

    def scores(i: int, gen: Any) -> list[float]:
        return [float(task.reward(prompts[i], c.text)["reward"]) for c in gen.completions]

    greedy_scores = [scores(i, g)[0] for i, g in enumerate(runs[:n])]
    groups = [scores(i, g) for i, g in enumerate(runs[n:])]
    flat = [s for g in groups for s in g]
    answers = Counter(p.answer for p in prompts)
    return {
        "prompts": n,
        "greedy_exact": sum(s >= 1.0 for s in greedy_scores) / max(n, 1),
        "greedy_score": statistics.fmean(greedy_scores) if n else 0.0,
        "sampled_exact": sum(s >= 1.0 for s in flat) / max(len(flat), 1),
        "sampled_score": statistics.fmean(flat) if flat else 0.0,
        "groups_with_signal": sum(max(g) > min(g) for g in groups) / max(n, 1),
        "constant": answers.most_common(1)[0][1] / n if n else 0.0,
        "greedy_examples": [g.completions[0].text[:120] for g in runs[: min(n, 3)]],
        "seconds": time.time() - t0,
    }


async def run(args: Any) -> dict[str, dict[str, dict[str, Any]]]:
    from asyncrl.actor.settings import ActorSettings
    from asyncrl.engine.backend import make_engine

    engine = None
    out: dict[str, dict[str, dict[str, Any]]] = {}
    try:
        for dataset in args.datasets:
            for shots in args.shots:
                cfg, task, path, prompts = task_of(args, dataset, shots)
                if engine is None:  # one engine: every probe differs in text only
                    engine = make_engine(path, ActorSettings.from_config(cfg.actor).engine, 0)
                    await engine.label(0)
                try:
                    row = await probe(engine, task, prompts, args)
                except Exception as e:  # noqa: BLE001 - one probe's failure, the rest go on
                    row = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
                out.setdefault(dataset, {})[str(shots)] = row
                print(f"{dataset} shots={shots}: {row}", file=sys.stderr, flush=True)
        return out
    finally:
        if engine is not None:
            engine.shutdown()


COLUMNS = ("greedy_exact", "greedy_score", "sampled_exact", "sampled_score",
           "groups_with_signal", "constant", "seconds")  # fmt: skip


def row_cells(r: dict[str, Any]) -> list[Any]:
    """A probe's table cells; a failed probe's error in the first."""
    if "error" in r:
        return [r["error"], *[""] * (len(COLUMNS) - 1)]
    return [r[c] for c in COLUMNS]


def main() -> None:
    p = parser("task_probe", __doc__)
    p.add_argument("--datasets", nargs="+", choices=list(DATASETS), default=list(DATASETS))
    p.add_argument("--shots", nargs="+", type=int, default=[0, 3], help="task.shots values")
    args = probe_args(p, 32, "answer")
    t0 = time.time()
    rows = asyncio.run(run(args))
    print_table(
        f"{args.model} on reasoning-gym datasets: {args.prompts} held-out prompts, greedy "
        f"and {args.samples} samples at T {args.temperature}, {args.max_tokens} tokens",
        ["dataset", "shots", "greedy exact", "greedy score", "sampled exact",
         "sampled score", "groups with signal", "constant", "s"],
        [[d, k, *row_cells(r)] for d, by in rows.items() for k, r in by.items()],
    )  # fmt: skip
    emit_json({"by_dataset": rows, "datasets": {d: DATASETS[d] for d in rows},
               "system": SYSTEM, "model": args.model, "dtype": args.dtype,
               "seconds": time.time() - t0, "host": host()})  # fmt: skip


if __name__ == "__main__":
    main()
