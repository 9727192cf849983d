"""``asyncrl-train``: check the config, wire the parts, run the loop, write the outputs.

    actors ──(refs)──▶ queue ──get_batch──▶ driver ──train_step(refs)──▶ learner
       ▲                                                                   │
       └────────────────── broker.publish(version) ◀───────────────────────┘

The loop itself is :func:`asyncrl.loop.run_loop`; this module is its command line.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from asyncrl import STARTUP_MARKS, startup_mark
from asyncrl.broker.base import BrokerError
from asyncrl.confdir import conf_dir
from asyncrl.config import ConfigError, hydra_error_line
from asyncrl.eval.launch import EvalRun
from asyncrl.eval.launch import launch as launch_eval
from asyncrl.fault.actors import fault_summary
from asyncrl.fault.learner import RestartLedger, close_dead_learner, learner_death
from asyncrl.learner.resume import save_checkpoint
from asyncrl.loop import LoopHooks, LoopResult, RunError, run_loop
from asyncrl.models.shipped import TINY_VLM, WEIGHTS_SHA256
from asyncrl.monitor import HealthMonitor, MonitorSettings
from asyncrl.parts import Parts
from asyncrl.runtime import GracefulStop, Interrupted, check_local_cpus, check_resources, init_ray
from asyncrl.sandbox import unconfined_warning
from asyncrl.utils.fingerprint import fingerprint, markdown
from asyncrl.utils.runlog import Scalars
from asyncrl.wiring import Setup, StartupClock, prepare, start_parts, stop_parts

log = logging.getLogger("asyncrl")
SIGNAL_EXIT = 130  # stopped by SIGINT/SIGTERM (the shell's 128 + SIGINT)


def summarise(
    cfg: DictConfig, loop: LoopResult, queue_stats: dict, actor_stats: dict, wall: float
) -> dict[str, Any]:
    per = loop.per_step
    k = max(1, len(per) // 10)

    def mean(rows):
        n = sum(c for _, c in rows)
        return sum(s for s, _ in rows) / n if n else float("nan")

    return {
        "steps": loop.steps,
        "policy_version": loop.policy_version,
        "reward_mean_first": mean(per[:k]),
        "reward_mean_last": mean(per[-k:]),
        "trajectories_produced": queue_stats["produced"],
        "trajectories_trained": queue_stats["trained"],
        "trajectories_dropped_stale": queue_stats["dropped_stale"],
        "trajectories_in_flight": queue_stats["in_flight"],
        "max_staleness_trained": queue_stats["max_staleness_trained"],
        # the widest bound in force during the run (replay.max_staleness=auto moves it)
        "max_staleness_bound": queue_stats.get("highest_bound", cfg.replay.max_staleness),
        "staleness_bound_final": queue_stats.get("max_staleness", cfg.replay.max_staleness),
        "staleness_bound_changes": queue_stats.get("bound_changes", 0),
        "staleness_histogram": {
            str(k): v for k, v in sorted(queue_stats["staleness_hist"].items())
        },
        "tokens_generated": sum(
            s.get("tokens", 0) for s in actor_stats.values() if isinstance(s, dict)
        ),
        "tokens_trained": loop.tokens_trained,
        "wall_seconds": round(wall, 2),
        **episode_means(actor_stats),
        "reward_by_task": by_task(loop.per_task),
        "actors": actor_stats,
    }


def by_task(per_task: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Each task's ``first`` and ``last`` reward: the mean of its per-step mean reward
    over the first and the last tenth of the steps that trained it, and ``steps``, how
    many did ({} when no task names its trajectories: a mixture's or env=browser's do)."""
    out = {}
    for name, vals in sorted(per_task.items()):
        k = max(1, len(vals) // 10)
        out[name] = {
            "first": sum(vals[:k]) / k,
            "last": sum(vals[-k:]) / k,
            "steps": len(vals),
        }
    return out


def episode_means(actor_stats: dict) -> dict[str, float | None]:
    """Over every trajectory the actors produced: turns and tool calls per episode (a
    single-turn episode is one turn, no call) and the prefix cache's hit rate over the
    turns' prompt tokens (None: no multi-turn episode, or no prompt token)."""
    stats = [s for s in actor_stats.values() if isinstance(s, dict)]
    n = sum(s.get("trajectories", 0) for s in stats)
    sums: dict[str, float] = {}
    for s in stats:
        for k, v in s.get("episode", {}).items():
            sums[k] = sums.get(k, 0.0) + v
    multi = sum(s.get("trajectories", 0) for s in stats if s.get("episode"))
    turns = sums.get("turns", 0.0) + (n - multi)  # single-turn episodes: one turn each
    prompt = sums.get("turn_prompt_tokens", 0.0)
    return {
        "turns_mean": turns / n if n else None,
        "tool_calls_mean": sums.get("tool_calls", 0.0) / n if n else None,
        "prefix_cache_hit_rate_mean": sums.get("cached_tokens", 0.0) / prompt if prompt else None,
    }


def run(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    stop = GracefulStop()  # SIGINT/SIGTERM: stop after the step, write everything
    stop.install()
    try:
        return _run(cfg, out_dir, stop)
    finally:
        stop.restore()


def _run(cfg: DictConfig, out_dir: Path, stop: GracefulStop) -> dict[str, Any]:
    t0 = time.time()
    startup_mark("imports")
    setup: Setup = prepare(cfg)  # every config error surfaces here, before Ray starts
    startup_mark("prepared")  # the config checked, the model resolved (built if need be)
    monitor = _before_ray(cfg, setup, out_dir)
    shipped = TINY_VLM.weights_sha256 if "vlm" in cfg.model else WEIGHTS_SHA256
    fp = fingerprint(cfg, setup.model_path, setup.run.seed, shipped)  # what it ran
    started = init_ray(setup.ray)
    startup_mark("ray_up")
    stop.install()  # over any handler ray.init set
    live = _Live(started_ray=started)
    scalars = Scalars(out_dir / "tb")
    scalars.text("fingerprint", markdown(fp))
    try:
        check_resources(setup.resources)
        live.eval_run = launch_eval(setup.evaluation, setup)  # beside the actors' engines
        clock = StartupClock(scalars)
        ledger = RestartLedger(clock, setup.fault.max_restarts, out_dir, cfg.resume)
        loop, hooks = _train(cfg, setup, live, ledger, monitor, out_dir, stop)
        summary = _finish(cfg, live, loop, ledger, time.time() - t0)
        summary["startup_seconds"] = clock.startup_seconds()  # process start -> first step
        summary["startup_phases"] = dict(STARTUP_MARKS)  # seconds from start at each point
        summary["fingerprint"] = fp
        summary["alerts"] = monitor.summary()  # name -> steps it fired, first step
        summary["stopped_by"] = stop.signame  # null: ran to max_steps
        if warning := unconfined_warning(setup.env.sandbox):  # sandbox.isolation=none
            summary["sandbox_warning"] = warning
        if hooks.evaluator is not None:  # set -> first, last, best, version_best
            summary["eval"] = hooks.evaluator.summary()
            summary["eval_skipped_versions"] = hooks.evaluator.skipped
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary
    finally:
        scalars.close()
        _release(live)


@dataclass
class _Live:
    """What ``_run`` stops on its way out, however it ends."""

    started_ray: bool  # Ray is shut down at the end
    parts: Parts | None = None  # the segment running (none between two)
    eval_run: EvalRun | None = None


def _release(live: _Live) -> None:
    if live.eval_run is not None:
        live.eval_run.stop()
    if live.parts is not None:
        stop_parts(live.parts, quiet=True)
        live.parts = None
    if live.started_ray:
        import ray

        ray.shutdown()


def _before_ray(cfg: DictConfig, setup: Setup, out_dir: Path) -> HealthMonitor:
    """The checks that need no Ray; the run directory's config.yaml; the run's alerts."""
    if setup.replay.delay_versions:
        raise ConfigError(
            f"replay.delay_versions={setup.replay.delay_versions} is the staleness benchmark's "
            "mode: it needs generation in lock-step with the learner, which "
            "benchmarks/staleness.py drives; this training loop would wait for groups the "
            "staleness window never lets the actors make. Use replay.max_staleness to bound "
            "staleness here."
        )
    monitor = HealthMonitor(
        MonitorSettings.from_config(cfg.get("monitor")),
        setup.replay.highest_bound,  # auto: the ceiling
        setup.reward.monitor,  # reward.monitor: the hacking/* rules
    )  # its thresholds are checked here too, before Ray starts
    check_local_cpus(setup.resources, setup.ray)  # what a local Ray will have, before it starts
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return monitor


def _train(
    cfg: DictConfig,
    setup: Setup,
    live: _Live,
    ledger: RestartLedger,
    monitor: HealthMonitor,
    out_dir: Path,
    stop: GracefulStop,
) -> tuple[LoopResult, LoopHooks]:
    """Segments of the run until one reaches the end: after a learner rank died
    (asyncrl/fault/learner.py) a new segment starts from the newest checkpoint.
    ``live.parts`` holds the last segment's parts, still running."""
    from ray.exceptions import RayError  # a dead rank's ActorDiedError, among others

    while True:
        parts = live.parts = start_parts(setup, out_dir, live.started_ray)
        hooks = LoopHooks(
            checkpoint_dir=out_dir / "checkpoint",
            progress=setup.run.progress,
            monitor=monitor,
            keep_checkpoints=setup.log.keep_checkpoints,
            evaluator=live.eval_run.evaluator(parts.learner) if live.eval_run else None,
            should_stop=stop.requested,
        )
        try:
            return _segment(cfg, setup, parts, ledger, hooks, out_dir, stop), hooks
        except (RayError, BrokerError, RunError, TimeoutError) as e:
            why = learner_death(e, parts.learner)
            if why is None:
                raise  # not the learner's: exit 3 (or the actors' own restarts)
            if stop.requested():  # the run was stopping anyway: no restart
                raise Interrupted(stop.signame, "after a learner rank died") from e
            stop.deferring = False  # a signal during the restart stops at once
            detected = time.time()
            close_dead_learner(parts)  # the broker killed, the ranks closed
            queue_stats, actor_stats = stop_parts(parts, quiet=True)
            live.parts = None
            faults = fault_summary(parts.supervisor, queue_stats)
            ledger.record_death(why, detected, queue_stats, actor_stats, faults)  # or RunError


def _finish(
    cfg: DictConfig, live: _Live, loop: LoopResult, ledger: RestartLedger, wall: float
) -> dict[str, Any]:
    """Stop the last segment's parts; the summary of the whole run, every segment
    counted."""
    parts = live.parts
    assert parts is not None  # _train returns with its last segment's parts running
    queue_stats, actor_stats = stop_parts(parts)
    live.parts = None
    actor_faults = ledger.actor_faults(fault_summary(parts.supervisor, queue_stats))
    loop, queue_stats = ledger.whole_run(loop, queue_stats)
    summary = summarise(cfg, loop, queue_stats, actor_stats, wall)
    summary["tokens_generated"] += ledger.tokens_before  # the dead segments' actors
    summary.update(ledger.summary())  # learner_restarts, steps_redone, restart_seconds
    summary["fault"] = actor_faults  # the actors' restarts (asyncrl/fault/actors.py)
    return summary


def _segment(
    cfg: DictConfig,
    setup: Setup,
    parts: Parts,
    ledger: RestartLedger,
    hooks: LoopHooks,
    out_dir: Path,
    stop: GracefulStop,
) -> LoopResult:
    """Resume (``resume=``, or after a restart the newest checkpoint), train to
    ``max_steps``, save the final checkpoint. A dead learner rank raises from here."""
    version = ledger.resume(parts)
    stop.deferring = True  # from here a signal ends the loop; the rest is still written
    loop = run_loop(cfg, parts, ledger, version, hooks)
    if hooks.evaluator is not None:  # the evaluation in flight (eval.timeout_s)
        ledger.log(loop.policy_version, hooks.evaluator.finish())
    keep = 0 if setup.log.keep_checkpoints else setup.learner.checkpoint_keep
    save_checkpoint(parts, out_dir, loop.policy_version, keep)  # queue + sampler state
    return loop


# An absolute path: relative, Hydra looks for a module named ``conf``, which only
# ``python -m`` from the repository root finds, not the ``asyncrl-train`` script. In a
# checkout it is the repository's conf/, in an installed wheel asyncrl/conf/.
CONF_DIR = str(conf_dir())


def execute(cfg: DictConfig, out_dir: Path) -> int:
    """Run, print the outcome, return the exit code: 0, 2 for a config error (one line
    naming the key, before Ray starts), 3 for a run that could not go on."""
    try:
        summary = run(cfg, out_dir)
    except ConfigError as e:
        print(f"asyncrl: config error: {_one_line(e)}", file=sys.stderr)
        return 2
    except (RunError, BrokerError) as e:  # BrokerError: every actor's engine is gone
        print(f"asyncrl: run failed: {_one_line(e)}", file=sys.stderr)
        return 3
    except Interrupted as e:
        what = "before the first step" if e.during == "during start-up" else "abandoning the step"
        print(
            f"asyncrl: stopped by {e.signame} {e.during}, {what}; outputs so far: {out_dir}",
            file=sys.stderr,
        )
        return SIGNAL_EXIT
    if summary["stopped_by"]:
        print(
            f"asyncrl: stopped by {summary['stopped_by']} after step {summary['policy_version']}"
            f" of {cfg.max_steps}: summary.json, checkpoint and trajectory log in {out_dir}",
            file=sys.stderr,
        )
        return SIGNAL_EXIT
    skip = ("actors", "staleness_histogram", "fingerprint")
    brief = {k: v for k, v in summary.items() if k not in skip}
    print(json.dumps(brief, indent=2))
    model = summary["fingerprint"]["model"]
    shipped = " (the shipped default)" if model["shipped"] else ""
    print(f"model weights sha256: {model['weights_sha256']}{shipped}", file=sys.stderr)
    print(f"outputs: {out_dir}", file=sys.stderr)
    return 0


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    code = execute(cfg, Path(HydraConfig.get().runtime.output_dir))
    if code:
        sys.exit(code)


def main() -> None:
    """``asyncrl-train``: Hydra composes the command line's overrides; an override it
    cannot compose (an unknown key or config-group option) is a config error too."""
    from hydra.errors import HydraException

    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises instead of printing many lines
    try:
        _hydra_main()
    except HydraException as e:
        print(f"asyncrl: config error: {hydra_error_line(e)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # before run() took over SIGINT: nothing started yet
        print("asyncrl: stopped by SIGINT during start-up, before Ray", file=sys.stderr)
        sys.exit(SIGNAL_EXIT)


if __name__ == "__main__":  # vLLM spawns processes: entry points need the guard
    main()
