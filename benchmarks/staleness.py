"""Does the off-policy correction hold learning under staleness?

Every sample is trained on exactly ``k`` policy versions after the one that generated
it (the first ``k`` steps ramp up: staleness ``min(V, k)``), for each correction and
for none, on the default task with the same sample budget and seeds.

    step V:  queue.get_batch(V)  opens the throttle window for the groups of version V
             and hands out the groups of version V-k (replay.delay_versions=k,
             replay.max_staleness=k)
             learner.train_step(V-k batch)  ║  actor generates the version-V groups
             wait until every version-V group is in the queue
             weights V+1 to the actor, waited for
             -> no group ever mixes versions and the staleness histogram is exactly
                {min(V, k)}: the script checks it after every run

"No correction" is ``loss=plain_pg`` (REINFORCE that ignores the behaviour
log-probs) with the off-policy brake off (``learner.optim.mismatch_kl_target=null``:
it reads the behaviour log-probs too); every other loss runs with the configured
brake (on by default, docs/losses.md). Final reward = mean reward of the samples trained in the last 10% of
steps (for k > 0 they were generated k versions before the end, so it lags by k
versions); same-version reward = mean reward of the samples that the same policy
versions generated in every run (the 10% of versions before ``steps - max(k)``): it
compares policies after equally many updates. ESS and mismatch KL (``is/ess``,
``is/mismatch_kl``: current policy vs behaviour) are averaged over the steps at
full staleness, as are the gradient norm before clipping (``grad_norm``) and the share
of those steps whose gradient was clipped (``grad_clip_frac``). Start reward = the
reward of the initial policy's samples (version 0), pooled over all runs; gain retention = (reward(k=8) - start) / (reward(k=0) - start):
the share of what was learnt at k=0 that survives k=8 (``retention_k8``, the ratio of
rewards, stays near 1 when little is learnt at all). ``retention_by_k`` gives, for every
loss and every k swept, each seed's ``reward(k) / reward(k=0)`` as mean, std, min, max
and n over the seeds (the table after the others and the plot's last panel);
``retention_by_k_same_version`` the same for the same-version reward (each run's
policies after equally many updates, so without the final reward's k-version lag).

``--summarise DIR...`` runs nothing: it merges the CSVs of earlier sweeps (e.g. one
per ``--losses`` subset, run apart) and reports them as one; ``--ks``, ``--losses``
and ``--seeds`` pick the runs to report, and with ``--share-k0`` a correction swept
without k=0 gets the seed's k=0 run of another (V-trace excepted).

``clipped`` is the training job's default loss (PPO's clipped surrogate against the
sampler), swept beside the four corrections and none.

The full sweep (5 k x 6 losses x 3 seeds x 300 steps) takes hours on a 2-core CPU;
``--quick`` runs k in {0, 8} for no correction and decoupled PPO, one seed, 40
steps, and runs k=0 once for both (on-policy they make the same update,
docs/losses.md; ``--share-k0`` does the same in any sweep, V-trace excepted).

One vLLM engine serves every run (engine start-up is most of a short run): between
runs it is pointed at the new run's queue and reloaded with the initial weights;
learner, queue and broker are new for every run. Weights go through the object
store (``broker=objectstore``): lossless like the process-group broker, and the
transport does not change what is learnt.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: see the note in benchmarks/common.py
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.common import (  # noqa: E402
    InStartOrder,
    Recorder,
    compose,
    emit_json,
    fingerprint_columns,
    parser,
    print_table,
    pyplot,
    ratio,
    run_fingerprint,
    start_ray,
    stop_all,
    write_csv,
)

LOSSES = {  # benchmark name -> conf/loss/<name>.yaml
    "none": "plain_pg",
    "tis": "tis",
    "mis": "mis",
    "decoupled_ppo": "decoupled_ppo",
    "vtrace": "vtrace",
    # the training job's default loss (PPO's clipped surrogate, the sampler as the "old"
    # policy): what a run with replay.max_staleness > 0 gets unless it picks another
    "clipped": "clipped",
    # the divergence-masking, sequence-ratio and clipped-weight losses (docs/losses.md)
    "dppo_mask": "dppo_mask",
    "icepop": "icepop",
    "m2po": "m2po",
    "gspo": "gspo",
    "cispo": "cispo",
    # decoupled PPO with AReaL's log-linear proximal policy (no proximal forward pass)
    "decoupled_ppo_loglinear": "decoupled_ppo",
}
LOSS_OVERRIDES = {"decoupled_ppo_loglinear": ("loss.proximal=loglinear",)}
KS = (0, 1, 2, 4, 8)
QUICK_KS = (0, 8)
# Losses whose update is the same at k=0 (behaviour = proximal = current: every ratio
# is 1, nothing is clipped or masked, the advantages are the estimator's), so
# --share-k0 runs k=0 once for them. V-trace is not among them: its critic-free
# advantages are r - group mean, whatever learner.advantage says; nor is GSPO: its
# bounds (3e-4, 4e-4) are below the sampler/learner numeric mismatch, so it clips at k=0.
SAME_ON_POLICY = (
    "none", "tis", "mis", "decoupled_ppo", "clipped", "dppo_mask", "icepop", "m2po", "cispo",
    "decoupled_ppo_loglinear",
)  # fmt: skip
QUICK_LOSSES = ("none", "decoupled_ppo")
FINAL_FRACTION = 0.1  # final reward: the samples of the last 10% of steps
# Settings every run shares on top of the default config (see the module docstring).
BENCH_OVERRIDES = ("broker=objectstore", "progress=false")
# "No correction" corrects nothing: neither weights nor the brake, whatever the overrides.
UNCORRECTED = {"none": ("learner.optim.mismatch_kl_target=null",)}
POLL_S = 0.01  # how often the driver looks whether the actor finished its batch


def wait_generated(parts: Any, produced: int, timeout_s: float) -> None:
    """Until the queue holds ``produced`` trajectories and nothing is generating."""
    import ray

    deadline = time.time() + timeout_s
    while True:
        s = ray.get(parts.queue.stats.remote())
        if s["produced"] >= produced and s["groups_running"] == 0:
            return
        if time.time() > deadline:
            states = ray.get([a.get_stats.remote() for a in parts.actors.values()])
            raise RuntimeError(f"the actor did not finish its batch: queue {s}, actor {states}")
        time.sleep(POLL_S)


def delayed_loop(cfg: Any, parts: Any, k: int, rec: Recorder) -> None:
    """The training loop (asyncrl.loop) in lock-step: while the learner trains on the
    version V-k batch, the actor makes every group of version V; each weight sync is
    waited for, so the actor generates version V+1 only."""
    from asyncrl.loop import LoopHooks, run_loop

    per_version = cfg.learner.batch_groups * cfg.actor.sampling.n  # trajectories

    def generated(version: int) -> None:
        wait_generated(parts, (version + k + 1) * per_version, cfg.replay.wait_timeout_s)

    queue, parts.queue = parts.queue, InStartOrder(parts.queue)
    try:
        run_loop(cfg, parts, rec, hooks=LoopHooks(during_step=generated, wait_for_sync=True))
    finally:
        parts.queue = queue


class Runner:
    """Runs one (loss, k, seed) after another on one engine."""

    def __init__(self, overrides: list[str], steps: int, out: Path, k_max: int):
        self.overrides, self.steps, self.out, self.k_max = overrides, steps, out, k_max
        self.actor: Any = None
        self.parking: Any = None  # a queue that never grants a slot: the engine idles there

    def config(self, loss: str, k: int, seed: int):
        return compose(
            *BENCH_OVERRIDES,
            *self.overrides,
            f"loss={LOSSES[loss]}",
            *LOSS_OVERRIDES.get(loss, ()),
            f"replay.delay_versions={k}",
            f"replay.max_staleness={k}",
            "replay.policy=throttle",
            f"seed={seed}",
            f"max_steps={self.steps}",
            *UNCORRECTED.get(loss, ()),
        )

    def run(self, loss: str, k: int, seed: int) -> tuple[dict[str, Any], list[dict[str, float]]]:
        import ray

        from asyncrl.broker import make_broker
        from asyncrl.wiring import prepare, start_parts

        cfg = self.config(loss, k, seed)
        setup = prepare(cfg)
        out = self.out / "runs" / f"{loss}-k{k}-s{seed}"
        out.mkdir(parents=True, exist_ok=True)
        fp = run_fingerprint(cfg, setup.model_path, seed)
        (out / "fingerprint.json").write_text(json.dumps(fp, indent=2))
        parts = start_parts(setup, out, started_ray=False, num_actors=0)  # ours is reused
        rec = Recorder()
        t0 = time.time()
        try:
            if self.actor is None:
                self.actor = self._new_actor(cfg, setup)
            ray.get(self.actor.halt.remote())
            ray.get(self.actor.rebind.remote(parts.queue, cfg.seed))
            if self.parking is not None:
                ray.kill(self.parking)
                self.parking = None
            parts.actors = {"actor0": self.actor}
            parts.broker.close()  # the one start_parts made had no actor to sync
            parts.broker = make_broker(setup.broker, parts.actors, parts.learner)
            parts.broker.publish(0)  # back to the initial weights, labelled version 0
            parts.broker.wait()
            ray.get(self.actor.resume.remote())
            delayed_loop(cfg, parts, k, rec)
        finally:
            if self.actor is not None:
                ray.get(self.actor.halt.remote())
            parts.actors = {}  # stop_all must not stop the shared engine
            queue_stats, _ = stop_all(parts)
        row = summarise(
            loss, k, seed, rec.steps, queue_stats, time.time() - t0, self.k_max,
            grad_clip=float(cfg.learner.optim.grad_clip),
        )  # fmt: skip
        row["lr"] = float(cfg.learner.optim.lr)
        row["schedule"] = schedule_name(cfg.learner.optim)
        target = cfg.learner.optim.get("mismatch_kl_target")
        row["kl_target"] = math.nan if target is None else float(target)  # nan: brake off
        row.update(fingerprint_columns(fp))  # the whole of it: runs/<run>/fingerprint.json
        return row, rec.steps

    def _new_actor(self, cfg: Any, setup: Any):
        """The one engine start-up of the benchmark; the actor waits on a parking queue
        (batch_groups=0: no slot ever) until a run rebinds it."""
        import ray

        from asyncrl.actor.launch import new_actor
        from asyncrl.replay.queue import remote_queue
        from tests.controlled_actor import ControlledRolloutActor

        self.parking = remote_queue(max_staleness=0, batch_groups=0)
        actor = new_actor(
            setup.actor, setup.model_path, setup.task, self.parking, "actor0", cfg.seed,
            cls=ControlledRolloutActor,
        )  # fmt: skip
        ray.get(actor.start.remote())
        return actor

    def close(self) -> None:
        import ray

        if self.actor is not None:
            ray.get(self.actor.stop.remote())
            ray.kill(self.actor)
            self.actor = None
        if self.parking is not None:
            ray.kill(self.parking)


def summarise(
    loss: str,
    k: int,
    seed: int,
    steps: list[dict[str, float]],
    q: dict[str, Any],
    seconds: float,
    k_max: int,
    grad_clip: float = 0.0,
) -> dict[str, Any]:
    """One run's row. ``final_reward``: samples trained in the last 10% of steps (for
    k > 0 generated k versions before the end). ``same_version_reward``: samples
    generated by the same policy versions in every run of the sweep, the 10% of
    versions before ``steps - k_max``: it compares policies after equally many
    updates, without the k-version lag of the final reward."""
    n = len(steps)
    w = max(1, math.ceil(n * FINAL_FRACTION))
    last = steps[-w:]
    lo, hi = max(0, n - k_max - w), max(1, n - k_max)
    same = [r for i, r in enumerate(steps) if lo <= i - min(i, k) < hi]
    start = [r for i, r in enumerate(steps) if i - min(i, k) == 0]  # version-0 samples
    full = steps[k:] or steps  # steps at full staleness (after the ramp)
    per_step = steps[0]["reward/count"] if steps else 0
    want = {min(v, k): 0 for v in range(n)}
    for v in range(n):
        want[min(v, k)] += int(per_step)
    hist = {int(s): c for s, c in q.get("staleness_hist", {}).items()}

    def mean(key: str, rows: list[dict[str, float]]) -> float:
        vals = [r[key] for r in rows if key in r]
        return sum(vals) / len(vals) if vals else float("nan")

    norms = [r["learner/grad_norm"] for r in full if "learner/grad_norm" in r]
    clip_frac = (
        sum(n > grad_clip for n in norms) / len(norms) if grad_clip > 0 and norms else math.nan
    )

    return {
        "loss": loss,
        "k": k,
        "seed": seed,
        "steps": n,
        "samples": int(sum(r["reward/count"] for r in steps)),
        "final_reward": _reward(last),
        "same_version_reward": _reward(same),
        "first_reward": steps[0]["reward/mean"] if steps else float("nan"),
        "start_reward": _reward(start),
        "start_samples": int(sum(r["reward/count"] for r in start)),
        "ess": mean("is/ess", full),
        "mismatch_kl": mean("is/mismatch_kl", full),
        "staleness_mean": mean("staleness/mean", full),
        "lr_scale": mean("learner/lr_scale", full),
        "grad_norm": mean("learner/grad_norm", full),
        "grad_clip_frac": clip_frac,  # steps at full staleness whose gradient was clipped
        "max_staleness": q.get("max_staleness_trained"),
        "dropped": q.get("dropped_stale"),
        "exact_staleness": hist == want,
        "seconds": seconds,
    }


def _reward(rows: list[dict[str, float]]) -> float:
    n = sum(r["reward/count"] for r in rows)
    return sum(r["reward/sum"] for r in rows) / n if n else float("nan")


def main() -> None:
    p = parser("staleness", __doc__)
    p.add_argument("--steps", type=int, default=None, help="learner steps per run (sample budget)")
    p.add_argument("--ks", type=int, nargs="+", default=None, help=f"staleness values ({KS})")
    p.add_argument("--losses", nargs="+", choices=list(LOSSES), default=None)
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    p.add_argument(
        "--share-k0",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"run k=0 once for {', '.join(SAME_ON_POLICY)} (on-policy they make the same "
        "update; V-trace runs its own); default: on with --quick. With --summarise: give "
        "those of them that lack a seed's k=0 run a copy of another's",
    )
    p.add_argument(
        "--summarise",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="run nothing: merge the staleness.csv and curves.csv of earlier sweeps (e.g. "
        "one per --losses, run apart), report them and write the merged files into --out; "
        "--ks, --losses and --seeds then pick the runs to report",
    )
    p.add_argument("overrides", nargs="*", help="training-config overrides for every run")
    args = p.parse_args()
    share_k0 = args.quick if args.share_k0 is None else args.share_k0
    steps = args.steps or (40 if args.quick else 300)
    ks = args.ks or (QUICK_KS if args.quick else KS)
    losses = args.losses or (QUICK_LOSSES if args.quick else list(LOSSES))
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])

    if args.summarise:
        rows, curves = load_runs(args.summarise)
        rows, curves = pick_runs(rows, curves, args.ks, args.losses, args.seeds)
        if args.share_k0:  # explicitly asked for: fill in the k=0 a loss's sweep left out
            share_missing_k0(rows, curves)
        ks = sorted({r["k"] for r in rows})
        losses = [name for name in LOSSES if any(r["loss"] == name for r in rows)]
        seeds = sorted({r["seed"] for r in rows})
        steps = max(r["steps"] for r in rows)
    else:
        bad = check_overrides(args.overrides, steps, ks, losses, seeds)
        if bad:  # a config that cannot compose fails now, not hours into the sweep
            p.error(bad)
        rows, curves = sweep(args, steps, ks, losses, seeds, share_k0)
    report(rows, curves, ks, losses, steps, seeds, args)


def check_overrides(overrides: list[str], steps: int, ks, losses, seeds) -> str:
    """'' if every run's config composes, else what is wrong: an override of one loss's
    settings (``loss.behaviour_cap=2.0``) does not fit the others, and would otherwise
    stop the sweep at that loss's first run."""
    runner = Runner(overrides, steps, Path("."), max(ks))
    for loss in losses:
        try:
            runner.config(loss, max(ks), seeds[0])
        except Exception as e:  # noqa: BLE001 - Hydra's and OmegaConf's errors, reported
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            return (
                f"the overrides {' '.join(overrides)} do not fit loss {loss} "
                f"(conf/loss/{LOSSES[loss]}.yaml): {msg}; sweep that loss apart"
            )
    return ""


def sweep(args, steps, ks, losses, seeds, share_k0) -> tuple[list[dict], list[dict]]:
    import ray

    rows, curves = [], []
    k0_run: dict[str, int] = {}  # this seed's shared k=0 run: index in rows, loss
    start_ray()
    runner = Runner(args.overrides, steps, args.out, max(ks))
    try:
        for seed in seeds:
            for k in ks:
                for loss in losses:
                    shared = share_k0 and k == 0 and loss in SAME_ON_POLICY
                    if shared and k0_run.get("seed") == seed:  # copy the shared run
                        i, src_loss = k0_run["row"], rows[k0_run["row"]]["loss"]
                        rows.append(dict(rows[i], loss=loss, shared_from=src_loss))
                        src = [c for c in curves if c["run"] == i and c["loss"] == src_loss]
                        curves += [dict(c, loss=loss, run=len(rows) - 1) for c in src]
                        continue
                    row, per_step = runner.run(loss, k, seed)
                    rows.append(row)
                    if shared:
                        k0_run = {"seed": seed, "row": len(rows) - 1}
                    curves += curve_rows(len(rows) - 1, row, per_step)
                    print(
                        f"{loss} k={k} seed={seed}: final reward {row['final_reward']:.3f} "
                        f"({row['seconds']:.0f} s)",
                        file=sys.stderr,
                    )
    finally:
        runner.close()
        ray.shutdown()

    return rows, curves


def report(rows, curves, ks, losses, steps, seeds, args) -> None:
    reward = seed_means(rows, "final_reward", ks, losses)
    same = seed_means(rows, "same_version_reward", ks, losses)
    retention = {loss: retention_k8(reward[loss]) for loss in losses}
    retention_same = {loss: retention_k8(same[loss]) for loss in losses}
    # Every run starts from the same initial policy: its reward, pooled over all runs,
    # is the baseline of the gain retained at k=8 (a ratio of rewards near the start
    # would look fine even if nothing was learnt).
    run_rows = [r for r in rows if not r.get("shared_from")]
    n0 = sum(r["start_samples"] for r in run_rows)
    start = sum(r["start_reward"] * r["start_samples"] for r in run_rows) / n0 if n0 else math.nan
    gain = {
        loss: ratio(
            reward[loss].get("8", math.nan) - start, reward[loss].get("0", math.nan) - start
        )
        for loss in losses
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "staleness.csv", rows)
    write_csv(args.out / "curves.csv", curves)
    by_k = retention_by_k(rows, ks, losses)
    plot(args.out / "staleness.png", curves, reward, ks, losses, by_k)
    table(rows, reward, retention, retention_same, gain, start, ks, losses, steps, seeds, args)
    by_k_same = retention_by_k(rows, ks, losses, "same_version_reward")
    for title, got in (("final", by_k), ("same-version", by_k_same)):
        print_table(
            f"retention by k ({title} reward): reward(k) / reward(k=0) of each seed, mean and "
            "sample std over the seeds that ran both (n)",
            ["loss", *[f"k={k}" for k in ks]],
            [[loss, *[_spread(got[loss][str(k)]) for k in ks]] for loss in losses],
        )
    emit_json(
        {
            "reward": reward,
            "retention_by_k": by_k,
            "retention_by_k_same_version": by_k_same,
            "retention_k8": retention,
            "retention_k8_same_version": retention_same,
            "start_reward": start,
            "gain_retention_k8": gain,
        }
    )


_INT_COLS = ("k", "seed", "steps", "samples", "max_staleness", "dropped", "start_samples")
_CURVE_INT = ("run", "k", "seed", "step", "samples")


def _typed_row(r: dict[str, str], ints) -> dict[str, Any]:
    """A CSV row with its columns typed: ``ints`` are ints, the names strings, the rest
    floats (blank: nan)."""
    out: dict[str, Any] = {}
    for key, v in r.items():
        if key in ints:
            out[key] = int(v)
        elif key in ("loss", "shared_from", "schedule") or key.startswith("fp_"):
            out[key] = v
        elif key == "exact_staleness":
            out[key] = v == "True"
        else:
            out[key] = float(v) if v not in ("", None) else math.nan
    return out


def _read_sweep(d: Path) -> tuple[list[dict], dict[tuple, list[dict]]]:
    """One sweep's rows and its curves by (loss, k, seed)."""
    import csv

    try:
        with (d / "staleness.csv").open() as f:
            got = [_typed_row(r, _INT_COLS) for r in csv.DictReader(f)]
        with (d / "curves.csv").open() as f:
            got_curves = [_typed_row(r, _CURVE_INT) for r in csv.DictReader(f)]
    except FileNotFoundError as e:
        raise SystemExit(f"--summarise {d}: no {Path(e.filename).name} there") from e
    by_run: dict[tuple, list[dict]] = {}
    for c in got_curves:
        by_run.setdefault((c["loss"], c["k"], c["seed"]), []).append(c)
    return got, by_run


def _refuse_mixed(seen: set[tuple], brakes: set[float | None]) -> None:
    """One table averages over seeds: sweeps of different settings do not merge."""
    settings = {key[3:] for key in seen}  # lr None: written before lr was recorded
    if len(settings) <= 1 and len(brakes) <= 1:
        return
    shown = ", ".join(
        f"lr {'not recorded' if lr is None else f'{lr:g}'} x {n} steps, "
        f"schedule {sched or 'not recorded'}"
        for lr, n, sched in sorted(settings, key=str)
    )
    brake = ", ".join("off" if b is None else f"{b:g}" for b in sorted(brakes, key=str))
    raise SystemExit(
        f"--summarise: these sweeps used different settings ({shown}; "
        f"mismatch_kl_target {brake}); summarise each setting on its own"
    )


def load_runs(dirs: list[Path]) -> tuple[list[dict], list[dict]]:
    """The rows and curves of earlier sweeps (their staleness.csv and curves.csv), one
    list across ``dirs``; a (loss, k, seed) met again is skipped, and sweeps of
    different learning rates or LR schedules (recorded or not) or step counts are
    refused: one table averages over seeds. Rows written before ``start_reward``
    existed get it from their curves."""
    rows: list[dict] = []
    curves: list[dict] = []
    seen: set[tuple] = set()
    brakes: set[float | None] = set()  # the corrections' mismatch_kl_target (None: off)
    for d in dirs:
        got, by_run = _read_sweep(d)
        for r in got:
            lr, target = r.get("lr", math.nan), r.get("kl_target", math.nan)
            if r["loss"] not in UNCORRECTED and not r.get("shared_from"):  # not a k=0 copy
                brakes.add(None if math.isnan(target) else target)
            key = (r["loss"], r["k"], r["seed"], None if math.isnan(lr) else lr, r["steps"])
            key += (r.get("schedule") or None,)  # None: written before it was recorded
            if key in seen:
                print(f"--summarise: {key} met again in {d}, skipped", file=sys.stderr)
                continue
            seen.add(key)
            # by (loss, k, seed), unique in a sweep: a shared k=0 copy's curves carried
            # the source run's number in sweeps before 2026-12-01
            mine = by_run.get((r["loss"], r["k"], r["seed"]), [])
            if "start_samples" not in r:
                r.update(_start_from_curves(mine, r["k"]))
            r["run"] = len(rows)
            rows.append(r)
            curves += [dict(c, run=r["run"]) for c in mine]
    if not rows:
        raise SystemExit("--summarise: no runs found")
    _refuse_mixed(seen, brakes)
    return rows, curves


def pick_runs(rows, curves, ks, losses, seeds) -> tuple[list[dict], list[dict]]:
    """``--summarise`` with ``--ks`` / ``--losses`` / ``--seeds``: only those runs (e.g.
    the seeds every k was run on, for a table whose columns average the same seeds)."""
    keep = [
        r
        for r in rows
        if (ks is None or r["k"] in ks)
        and (losses is None or r["loss"] in losses)
        and (seeds is None or r["seed"] in seeds)
    ]
    if not keep:
        raise SystemExit("--summarise: no run matches --ks/--losses/--seeds")
    new = {r["run"]: i for i, r in enumerate(keep)}  # run = the row's place, as written
    return (
        [dict(r, run=new[r["run"]]) for r in keep],
        [dict(c, run=new[c["run"]]) for c in curves if c["run"] in new],
    )


def share_missing_k0(rows: list[dict], curves: list[dict]) -> int:
    """``--summarise --share-k0``: a loss of ``SAME_ON_POLICY`` without a k=0 run for a
    seed gets a copy of that seed's k=0 run of another one (on-policy they make the same
    update), marked ``shared_from`` as ``--share-k0`` marks it in a sweep; e.g. masked IS
    swept at k=8 alone, beside a sweep whose k=0 ran for decoupled PPO. Returns how many
    rows were added."""
    present = [name for name in SAME_ON_POLICY if any(r["loss"] == name for r in rows)]
    added = 0
    for seed in sorted({r["seed"] for r in rows}):
        k0 = {r["loss"]: r for r in rows if r["k"] == 0 and r["seed"] == seed}
        src = next((k0[name] for name in SAME_ON_POLICY if name in k0), None)
        if src is None:
            continue
        for loss in present:
            if loss in k0:
                continue
            run = len(rows)
            origin = src.get("shared_from") or src["loss"]
            rows.append(dict(src, loss=loss, shared_from=origin, run=run))
            curves += [dict(c, loss=loss, run=run) for c in curves if c["run"] == src["run"]]
            added += 1
    return added


def _start_from_curves(curves: list[dict], k: int) -> dict[str, Any]:
    """start_reward / start_samples of one run: its steps that trained version-0 samples."""
    n = total = 0.0
    prev = 0
    for i, c in enumerate(sorted(curves, key=lambda c: c["step"])):
        count = c["samples"] - prev
        prev = c["samples"]
        if i - min(i, k) == 0:
            n += count
            total += c["reward"] * count
    return {"start_reward": total / n if n else math.nan, "start_samples": int(n)}


def curve_rows(run: int, row: dict[str, Any], per_step: list[dict[str, float]]) -> list[dict]:
    out, samples = [], 0
    for r in per_step:
        samples += int(r["reward/count"])
        out.append(
            {
                "run": run,
                "loss": row["loss"],
                "k": row["k"],
                "seed": row["seed"],
                "step": int(r["step"]),
                "samples": samples,
                "reward": r["reward/mean"],
                "staleness": r["staleness/mean"],
                "ess": r.get("is/ess"),
                "mismatch_kl": r.get("is/mismatch_kl"),
                "grad_norm": r.get("learner/grad_norm"),
                "lr": r.get("learner/lr"),
            }
        )
    return out


def seed_means(rows: list[dict], key: str, ks, losses) -> dict[str, dict[str, float]]:
    """loss -> str(k) -> mean over seeds of ``key``."""
    return {
        loss: {
            str(k): _mean([r[key] for r in rows if r["loss"] == loss and r["k"] == k]) for k in ks
        }
        for loss in losses
    }


def retention_by_k(
    rows: list[dict], ks, losses, column: str = "final_reward"
) -> dict[str, dict[str, dict[str, float]]]:
    """loss -> str(k) -> the retention of ``column`` (the final reward, or the
    same-version reward) over seeds: each seed's ``reward(k) / reward(k=0)`` (the seed's
    own k=0 run, or the copy --share-k0 made), their ``mean``, sample ``std`` (0 for one
    seed), ``min``, ``max`` and ``n`` (seeds with both runs; nan figures when none)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for loss in losses:
        mine = [r for r in rows if r["loss"] == loss]
        base = {r["seed"]: r[column] for r in mine if r["k"] == 0}
        out[loss] = {}
        for k in ks:
            per_seed = [
                ratio(r[column], base[r["seed"]]) for r in mine if r["k"] == k and r["seed"] in base
            ]
            out[loss][str(k)] = _spread_of([x for x in per_seed if not math.isnan(x)])
    return out


def _spread_of(xs: list[float]) -> dict[str, float]:
    n = len(xs)
    mean = _mean(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    return {
        "mean": mean,
        "std": std if n else math.nan,
        "min": min(xs, default=math.nan),
        "max": max(xs, default=math.nan),
        "n": n,
    }


def _spread(s: dict[str, float]) -> str:
    return f"{s['mean']:.3f} ± {s['std']:.3f} (n={s['n']})" if s["n"] else "-"


def retention_k8(by_k: dict[str, float]) -> float:
    return ratio(by_k.get("8", math.nan), by_k.get("0", math.nan))


def schedule_name(optim: Any) -> str:
    """The LR schedule in a CSV cell: ``constant`` or ``cosine``, with a warm-up and the
    cosine's floor when set (``cosine/warmup 10/floor 0.1``); ``lr`` is its peak."""
    name = str(optim.schedule)
    if optim.get("warmup_steps"):
        name += f"/warmup {optim.warmup_steps}"
    if name.startswith("cosine") and optim.get("min_lr_ratio"):
        name += f"/floor {optim.min_lr_ratio:g}"
    return name


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def table(rows, reward, retention, retention_same, gain, start, ks, losses, steps, seeds, args):
    # with a loss of the sweep, so that an override of that loss's settings fits
    c = compose(*BENCH_OVERRIDES, *args.overrides, f"loss={LOSSES[losses[0]]}")
    lrs = {r["lr"] for r in rows if not math.isnan(r.get("lr", math.nan))}
    lr = f"{lrs.pop():g}" if lrs else "not recorded"  # load_runs refuses mixed lrs
    scheds = {r["schedule"] for r in rows if r.get("schedule")}  # and mixed schedules
    lr += f" ({scheds.pop()})" if scheds else ""
    subset = f"k in {list(ks)}, losses {list(losses)}, seeds {seeds}"
    if args.quick:
        subset = "--quick subset: " + subset
    shared = [r for r in rows if r.get("shared_from")]
    if shared:
        subset += f"; k=0 run once (loss {shared[0]['shared_from']}) and shared"
    print_table(
        f"learning under exact staleness k: {steps} steps x {c.learner.batch_groups} groups x "
        f"n={c.actor.sampling.n} samples per run, lr {lr}, task max_operand "
        f"{c.task.max_operand}; {subset}",
        ["loss", "k", "seed", "final reward", "same-version reward", "first reward", "ESS",
         "mismatch KL", "exact k"],
        [
            [r["loss"], r["k"], r["seed"], r["final_reward"], r["same_version_reward"],
             r["first_reward"], r["ess"], r["mismatch_kl"], r["exact_staleness"]]
            for r in rows
        ],
    )  # fmt: skip
    print_table(
        "final reward (mean over seeds) by k; retention = reward(k=8) / reward(k=0), also "
        f"for the same-version reward (policy versions {max(ks)} before the end in every run); "
        f"gain retention = (reward(k=8) - start) / (reward(k=0) - start), start = {start:.3f} "
        "(the initial policy's reward, all runs pooled)",
        ["loss", *[f"k={k}" for k in ks], "retention k8", "same-version retention k8",
         "gain retention k8"],
        [
            [loss, *[reward[loss][str(k)] for k in ks], retention[loss], retention_same[loss],
             gain[loss]]
            for loss in losses
        ],
    )  # fmt: skip
    bad = [f"{r['loss']} k={r['k']} seed={r['seed']}" for r in rows if not r["exact_staleness"]]
    if bad:
        print(f"WARNING: staleness was not exactly min(V, k) in: {', '.join(bad)}")
    print(f"outputs: {args.out}")


def plot(path: Path, curves, reward, ks, losses, by_k, window: int = 10) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(losses) + 2, figsize=(4 * (len(losses) + 2), 3.6))
    for ax, loss in zip(axes, losses):
        for k in ks:
            pts: dict[int, list[float]] = {}
            for c in curves:
                if c["loss"] == loss and c["k"] == k:
                    pts.setdefault(c["samples"], []).append(c["reward"])
            xs = sorted(pts)
            ys = [_mean(pts[x]) for x in xs]
            smooth = [_mean(ys[max(0, i - window + 1) : i + 1]) for i in range(len(ys))]
            ax.plot(xs, smooth, label=f"k={k}")
        ax.set_title(f"{loss}")
        ax.set_xlabel("samples trained")
        ax.set_ylabel(f"reward (mean of {window} steps)")
        ax.legend(fontsize=7)
    ax = axes[-2]
    for loss in losses:
        ax.plot(list(ks), [reward[loss][str(k)] for k in ks], marker="o", label=loss)
    ax.set_xlabel("staleness k (versions)")
    ax.set_ylabel("final reward")
    ax.set_title("final reward vs k")
    ax.legend(fontsize=7)
    ax = axes[-1]
    for loss in losses:
        got = [(k, by_k[loss][str(k)]) for k in ks if by_k[loss][str(k)]["n"]]
        ax.errorbar(
            [k for k, _ in got], [s["mean"] for _, s in got], yerr=[s["std"] for _, s in got],
            marker="o", capsize=3, label=loss,
        )  # fmt: skip
    ax.set_xlabel("staleness k (versions)")
    ax.set_ylabel("reward(k) / reward(k=0)")
    ax.set_title("retention vs k (mean ± std over seeds)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
