"""Does a pretrained model get better at a task someone else wrote? A model (default
``model=smollm2``, SmolLM2-135M-Instruct) trained by the real runtime on each of
``--tasks``, with its held-out accuracy measured before and after by the run's own
evaluation actor (asyncrl/eval/), on three held-out prompt sets drawn with different
seeds.

    per task:  parts + an EvalActor (its own engine) ─▶ Evaluator.step(0): version 0
               (the model as loaded) scored on the sets ─▶ the training loop, --steps
               versions (the evaluation of the last version starts as it is published)
               ─▶ Evaluator.finish(): the last version scored on the same sets

A set's figure is greedy pass@1 (and pass@k of ``eval.k`` samples), and the task's own
mean score of the greedy answers (``score_*``: partial credit counts, as reasoning-gym's
scorers give it to a right number inside a sentence). ``spread_before``
is the largest minus the smallest of the sets' pass@1 before training: how much the
"before" figure moves with which held-out problems are drawn. ``gain`` is the sets'
mean pass@1 after minus before; ``learned`` says whether the gain exceeds that spread
(``score_spread_before``, ``score_gain``, ``score_learned``: the same for the score).
The training reward of the first and last tenth of the steps and the run's accounting
(produced = trained + dropped + in flight) come with it. The last stdout line is one
JSON object: ``by_task`` (one entry per task), ``model``, ``steps`` and the host.

    python -m benchmarks.learn                     # every task below, 30 steps each
    python -m benchmarks.learn --tasks chain_sum --steps 20 learner.optim.lr=1e-5
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: see the note in benchmarks/common.py
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import statistics  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.common import (  # noqa: E402
    Recorder,
    compose,
    emit_json,
    host,
    parser,
    print_table,
    run_fingerprint,
    start_ray,
    stop_all,
    write_csv,
)
from benchmarks.tool_probe import OVERRIDES as TOOL_OVERRIDES  # noqa: E402
from benchmarks.tool_probe import VARIANTS as TOOL_VARIANTS  # noqa: E402
from benchmarks.tool_probe import hydra_value  # noqa: E402

TOOL_VARIANT = "hermes_fewshot"  # of benchmarks/tool_probe.py: the calculator_tool task's prompt

# --tasks: name -> the task's overrides. chain_sum is reasoning-gym's (its generator and
# its own scorer, which gives full credit to the bare number only): two terms of 1-2
# digits, added or subtracted, and the system prompt of model=smollm2's addition, so that
# a 135M model starts above zero (docs/models.md); addition is asyncrl's own task in chat
# form, which model=smollm2 trains by default.
TASKS: dict[str, list[str]] = {
    "chain_sum": [
        "task=reasoning_gym",
        "task.dataset=chain_sum",
        "+task.config={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 2}",
        "task.system='You are a calculator. Reply with the result as a number only.'",
    ],
    "addition": [],
    # reasoning-gym's syllogism: "Does it logically follow ...? (Answer Yes or No)", scored
    # exactly; SmolLM2 mostly answers in sentences (greedy 6% exact on 32 problems), and
    # 68.5% of the dataset's answers are "Yes" (``majority`` says what always-Yes scores).
    "syllogism": [
        "task=reasoning_gym",
        "task.dataset=syllogism",
        "task.system='Reply with the answer only.'",
    ],
    # reasoning-gym's number_format: pick the largest or smallest of 3-5 numbers written in
    # different formats ("757,954,644.986", "7.57954645211e+08"), scored by value; every
    # problem has its own answer (no constant answer scores), and SmolLM2 greedy starts at
    # 7 of 48 exact (docs/models.md). Questions reach ~150 tokens, answers ~18.
    "number_format": [
        "task=reasoning_gym",
        "task.dataset=number_format",
        "task.system='Reply with the answer only.'",
        "actor.engine.max_model_len=320",
        "actor.sampling.max_tokens=32",
        "+actor.engine.extra.max_num_batched_tokens=10240",  # 32 prompts of a step at once
    ],
    # reasoning-gym's basic_arithmetic: two 1-digit terms with +, -, *, / (exact quotients),
    # negation and brackets ("Calculate ( -9 / 9 )."), 77 distinct answers, the commonest
    # 6% of the dataset; three worked examples before each question (task.shots), so that
    # SmolLM2 answers bare (benchmarks/task_probe.py: greedy 0 of 48 exact without them, 8
    # of 48 with them).
    "basic_arithmetic": [
        "task=reasoning_gym",
        "task.dataset=basic_arithmetic",
        "+task.config={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}",
        "task.system='Reply with the answer only.'",
        "task.shots=3",
        "actor.engine.max_model_len=256",  # the examples and the question: ~130 tokens
        "actor.sampling.max_tokens=8",  # "-12" and its end are 3 tokens
    ],
    # reasoning-gym's word_sorting: three words sorted up or down by ASCII order, the
    # answer a comma-separated list, scored in part; with three worked examples SmolLM2
    # answers bare, 7 of 48 exact and a reward spread in 45 of 48 groups (task_probe).
    "word_sorting": [
        "task=reasoning_gym",
        "task.dataset=word_sorting",
        "+task.config={min_words: 3, max_words: 3}",
        "task.system='Reply with the answer only.'",
        "task.shots=3",
        "actor.engine.max_model_len=512",  # the examples and the question: up to ~400 tokens
        "actor.sampling.max_tokens=24",  # three words, their commas and the end
    ],
}
# calculator_tool: env=calculator_chat with SmolLM2's template and hermes `<tool_call>` JSON
# (the format a ChatML model's tool calls take; SmolLM2's template has no tool section, so
# the schema is described in the system message), two worked examples as chat turns before
# each prompt: benchmarks/tool_probe.py's variant with the most signal. The
# held-out evaluation runs each prompt as whole episodes (asyncrl/eval/actor.py).
TASKS["calculator_tool"] = [
    *TOOL_OVERRIDES,
    *(f"{k}={hydra_value(v)}" for k, v in TOOL_VARIANTS[TOOL_VARIANT].items()),
    "actor.sampling.max_tokens=48",  # a hermes call is ~30 tokens
    # three factors: with two (the examples' own) SmolLM2 answers all 48 probe prompts
    # greedily, leaving nothing to gain; with three, 38 of 48 (sampled at T 1: 20%)
    "task.num_operands=3",
]
EVAL_SEEDS = (1, 2, 3)  # one held-out set per seed (eval.sets.<name>.seed)
HELDOUT_FRAC = 0.3  # enough held-out problems that three sets of --eval-prompts differ
LAST_SHARE = 0.1  # the training reward's first and last tenth of the steps
# how long the before and after evaluations are waited for: on a loaded 2-core host
# three sets of 64 greedy prompts and pass@k took over the default 300 s
EVAL_TIMEOUT_S = 1800


def eval_overrides(steps: int, prompts: int, k: int) -> list[str]:
    sets = ", ".join(f"s{s}: {{seed: {s}}}" for s in EVAL_SEEDS)
    return [
        f"eval.every={steps}",
        f"eval.num_prompts={prompts}",
        f"eval.k={k}",
        f"eval.heldout_frac={HELDOUT_FRAC}",
        f"eval.timeout_s={EVAL_TIMEOUT_S}",
        "~eval.sets",
        f"+eval.sets={{{sets}}}",
    ]


def run_task(name: str, overrides: list[str], args: Any) -> dict[str, Any]:
    from asyncrl.eval.launch import launch
    from asyncrl.loop import LoopHooks, run_loop
    from asyncrl.wiring import prepare, start_parts

    cfg = compose(
        f"model={args.model}", *TASKS[name], *overrides,
        *eval_overrides(args.steps, args.eval_prompts, args.eval_k),
        f"max_steps={args.steps}", "progress=false",
    )  # fmt: skip
    setup = prepare(cfg)
    out = args.out / name
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    eval_run = launch(setup.evaluation, setup)
    parts = start_parts(setup, out, started_ray=False)
    rec = Recorder()
    try:
        evaluator = eval_run.evaluator(parts.learner)
        evaluator.step(0)  # version 0: the model as loaded, before any step
        first = evaluator.finish()
        t_train = time.time()
        run_loop(cfg, parts, rec, hooks=LoopHooks(evaluator=evaluator))
        train_s = time.time() - t_train
        last = evaluator.finish()  # the last version's evaluation
    finally:
        q, _ = stop_all(parts)
        eval_run.stop()
    row = summarise(name, evaluator.history, rec.steps, q, train_s, time.time() - t0)
    return {**row, **scores(first, last), **majority(setup.evaluation.sets, row["mean_after"])}


def majority(sets: dict[str, tuple[Any, list[Any]]], mean_after: float) -> dict[str, Any]:
    """The share of each held-out set's commonest answer: the pass@1 of a policy that
    always gives it (a yes/no task's floor for learning the task rather than its format),
    and whether the sets' mean pass@1 after training is above it."""
    shares = []
    for _, prompts in sets.values():
        counts = Counter(p.answer for p in prompts)
        shares.append(max(counts.values()) / len(prompts) if prompts else float("nan"))
    floor = statistics.fmean(shares) if shares else float("nan")
    return {"majority": shares, "above_majority": bool(mean_after > floor)}


def scores(first: dict[str, float], last: dict[str, float]) -> dict[str, Any]:
    """The task's own mean score of the greedy answers per set, before and after
    (``eval/<set>/reward_mean``: partial credit counts, where pass@1 needs a full one)."""

    def per_set(m: dict[str, float]) -> list[float]:
        keys = sorted(k for k in m if k.startswith("eval/") and k.endswith("/reward_mean"))
        return [m[k] for k in keys]

    before, after = per_set(first), per_set(last)
    spread = max(before) - min(before) if before else float("nan")
    gain = statistics.fmean(after) - statistics.fmean(before) if before and after else float("nan")
    return {
        "score_before": before,
        "score_after": after,
        "score_spread_before": spread,
        "score_gain": gain,
        "score_learned": bool(gain > spread),
    }


def summarise(
    name: str,
    history: dict[str, list[tuple[int, float, float]]],
    steps: list[dict[str, float]],
    queue: dict[str, Any],
    train_s: float,
    total_s: float,
) -> dict[str, Any]:
    """One task's row from the evaluator's history (set -> [(version, pass@1, pass@k)])."""
    before = {s: rows[0] for s, rows in history.items() if rows and rows[0][0] == 0}
    after = {s: rows[-1] for s, rows in history.items() if len(rows) > 1}
    b1 = [r[1] for r in before.values()]
    a1 = [r[1] for r in after.values()]
    spread = max(b1) - min(b1) if b1 else float("nan")
    gain = statistics.fmean(a1) - statistics.fmean(b1) if a1 and b1 else float("nan")
    n = max(1, round(LAST_SHARE * len(steps)))

    def reward(rows: list[dict[str, float]]) -> float:
        count = sum(r["reward/count"] for r in rows)
        return sum(r["reward/sum"] for r in rows) / count if count else float("nan")

    return {
        "task": name,
        "pass1_before": b1,
        "pass1_after": a1,
        "passk_before": [r[2] for r in before.values()],
        "passk_after": [r[2] for r in after.values()],
        "version_after": max((r[0] for r in after.values()), default=None),
        "mean_before": statistics.fmean(b1) if b1 else float("nan"),
        "mean_after": statistics.fmean(a1) if a1 else float("nan"),
        "spread_before": spread,
        "gain": gain,
        "learned": bool(gain > spread),
        "reward_first": reward(steps[:n]),
        "reward_last": reward(steps[-n:]),
        "steps": len(steps),
        "train_seconds": train_s,
        "seconds": total_s,
        "produced": queue["produced"],
        "trained": queue["trained"],
        "dropped_stale": queue["dropped_stale"],
        "in_flight": queue["in_flight"],
        "accounted": queue["produced"]
        == queue["trained"] + queue["dropped_stale"] + queue["in_flight"],
    }


def arguments():
    p = parser("learn", __doc__)
    p.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    p.add_argument("--model", default="smollm2", help="a conf/model preset")
    p.add_argument("--steps", type=int, default=None, help="learner steps per task (30; --quick 4)")
    p.add_argument("--eval-prompts", type=int, default=64, help="prompts per held-out set")
    p.add_argument("--eval-k", type=int, default=4, help="samples per prompt for pass@k")
    p.add_argument("overrides", nargs="*", help="training-config overrides for every task")
    args = p.parse_args()
    args.steps = args.steps or (4 if args.quick else 30)
    for t in args.tasks:  # a bad override or task: now, before Ray
        compose(f"model={args.model}", *TASKS[t], *args.overrides,
                *eval_overrides(args.steps, args.eval_prompts, args.eval_k))  # fmt: skip
    return args


def main() -> None:
    args = arguments()
    import ray

    start_ray()
    rows = []
    try:
        for t in args.tasks:
            rows.append(run_task(t, args.overrides, args))
            print(f"{t}: {rows[-1]['seconds']:.0f} s", file=sys.stderr)
    finally:
        ray.shutdown()
    write_csv(args.out / "learn.csv", [{k: (str(v) if isinstance(v, list) else v)
                                       for k, v in r.items()} for r in rows],
              fingerprint=run_fingerprint())  # fmt: skip
    print_table(
        f"{args.model}: held-out pass@1 before and after {args.steps} steps "
        f"(sets of {args.eval_prompts} prompts, seeds {list(EVAL_SEEDS)})",
        ["task", "pass@1 before (per set)", "after", "spread before", "gain", "learned",
         "score before", "after", "spread", "gain", "learned", "majority", "above it",
         "reward first -> last",
         "train s", "accounted"],
        [[r["task"], " ".join(f"{x:.3f}" for x in r["pass1_before"]),
          " ".join(f"{x:.3f}" for x in r["pass1_after"]), r["spread_before"], r["gain"],
          r["learned"], " ".join(f"{x:.3f}" for x in r["score_before"]),
          " ".join(f"{x:.3f}" for x in r["score_after"]), r["score_spread_before"],
          r["score_gain"], r["score_learned"],
          " ".join(f"{x:.3f}" for x in r["majority"]), r["above_majority"],
          f"{r['reward_first']:.3f} -> {r['reward_last']:.3f}",
          r["train_seconds"], r["accounted"]] for r in rows],
    )  # fmt: skip
    emit_json({"by_task": {r["task"]: r for r in rows}, "model": args.model,
               "steps": args.steps, "host": host()})  # fmt: skip


if __name__ == "__main__":
    main()
