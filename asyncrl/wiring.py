"""Build every part from config: ``prepare`` checks every component's settings and
builds what is cheap (in the driver, before Ray starts, so config errors surface at
once); ``start_parts`` starts the Ray actors; ``stop_parts`` stops them (the broker
included) without losing the accounting."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from asyncrl.actor.settings import ActorSettings
from asyncrl.broker.settings import BrokerSettings
from asyncrl.config import ConfigError, Settings, build, setting, settings_from
from asyncrl.envs.settings import EnvSettings
from asyncrl.eval.launch import EvalPlan, prepare_eval
from asyncrl.eval.settings import EvalSettings
from asyncrl.fault.settings import FaultSettings
from asyncrl.learner.config import LearnerSettings
from asyncrl.models.resolve import resolve_model  # model.preset / path / tiny, checked
from asyncrl.replay.settings import ReplaySettings
from asyncrl.rewards.settings import RewardSettings
from asyncrl.runtime import Parts, RaySettings
from asyncrl.tasks.sampler import SamplerSettings, with_sampler
from asyncrl.utils.affinity import keep_off, restore
from asyncrl.utils.runlog import LogSettings

log = logging.getLogger(__name__)


@dataclass
class RunSettings(Settings):
    """The top level of the config (the component groups have their own settings)."""

    max_steps: int = setting(">= 1")
    seed: int = setting()
    resume: str | None = setting()
    progress: bool = setting()


@dataclass
class Setup:
    """Everything the driver checked and built before Ray starts."""

    model_path: str
    task: Any
    loss: Any
    advantage: Any
    run: RunSettings
    actor: ActorSettings
    learner: LearnerSettings
    broker: BrokerSettings
    replay: ReplaySettings
    ray: RaySettings
    resources: dict[str, float] = field(default_factory=dict)
    env: EnvSettings = field(default_factory=EnvSettings.defaults)  # the episodes'
    log: LogSettings = field(default_factory=LogSettings.defaults)  # the trajectory log's parts
    evaluation: EvalPlan = field(default_factory=lambda: EvalPlan(EvalSettings.defaults()))
    reward: RewardSettings = field(default_factory=RewardSettings.defaults)  # components, workers
    fault: FaultSettings = field(default_factory=FaultSettings.defaults)  # restarts (asyncrl/fault)


def build_task(cfg: DictConfig) -> Any:
    task = build("task", cfg.task)
    try:
        from asyncrl.tasks.base import TaskSampler

        first = TaskSampler(task, cfg.seed).next()
        if not getattr(first, "text", None):
            raise ValueError(f"the task's first prompt is empty: {first!r}")
    except Exception as e:
        raise ConfigError(
            f"task ({cfg.task.get('_target_')}): cannot draw a prompt: {type(e).__name__}: {e}"
        ) from e
    return task


def _checkpoint_keep(cfg: DictConfig) -> None:
    """``checkpoint.keep`` (the name issue 25 gives it), when set, is
    ``learner.checkpoint_keep`` (beside ``learner.checkpoint_every``): written through, so
    the loop, the restarts and the saved config.yaml see one value."""
    keep = (cfg.get("checkpoint") or {}).get("keep")
    if keep is None:
        return
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise ConfigError(f"checkpoint.keep={keep!r}: must be an integer >= 0 (0: keep all)")
    cfg.learner.checkpoint_keep = keep


def prepare(cfg: DictConfig) -> Setup:
    """Check every component's settings and build the cheap parts, in the driver before
    Ray starts: every config error surfaces here as one ConfigError naming its key.
    Settings first (cheap, pure Python), then what imports torch, then the model."""
    run = settings_from(RunSettings, {k: cfg.get(k) for k in ("max_steps", "seed", "resume",
                                                              "progress")}, "")  # fmt: skip
    ray_settings = RaySettings.from_config(cfg.ray)
    actor = ActorSettings.from_config(cfg.actor)
    replay = ReplaySettings.from_config(cfg.replay)
    broker = BrokerSettings.from_config(cfg.broker)
    task = build_task(cfg)
    env = EnvSettings.from_config(cfg.get("env"), cfg.get("sandbox"))  # sandbox.*: env=code
    log_settings = LogSettings.from_config(cfg.get("log"))
    reward = RewardSettings.from_config(cfg.get("reward"))
    fault = FaultSettings.from_config(cfg.get("fault"))
    evaluation = EvalSettings.from_config(cfg.get("eval"))
    sampler = SamplerSettings.from_config(cfg.get("sampler"))
    loss = build("loss", cfg.loss)
    if not callable(loss):
        raise ConfigError(
            f"loss._target_={cfg.loss._target_} is not callable as loss(batch, outputs)"
        )
    _checkpoint_keep(cfg)
    learner = LearnerSettings.from_config(cfg.learner, loss, run.max_steps)
    advantage = build("learner.advantage", cfg.learner.advantage)
    batch_size = learner.batch_groups * actor.sampling.n
    if learner.minibatches > batch_size:
        raise ConfigError(
            f"learner.minibatches={learner.minibatches} is more than the "
            f"{batch_size} trajectories of a batch (learner.batch_groups x actor.sampling.n)"
        )
    if learner.resources and not ray_settings.address:
        raise ConfigError(
            f"learner.resources={learner.resources}: a local Ray (ray.address=null) has no "
            "custom resources to place the ranks by; set ray.address to a cluster whose "
            "nodes declare them (docs/cluster.md)"
        )
    if run.resume:
        from asyncrl.learner.config import check_resume

        check_resume(run.resume)
    model_path = resolve_model(cfg, task)
    # with eval.every > 0: the held-out sets, and the training task without their prompts
    eval_plan, task = prepare_eval(evaluation, task)
    task = with_sampler(task, sampler)  # how the actors draw prompts (sampler=adaptive)
    resources = {
        "actors": actor.num_actors * actor.num_cpus,
        "learner": learner.world_size * learner.num_cpus,
        "eval": evaluation.num_cpus if evaluation.enabled else 0,
    }
    return Setup(
        model_path, task, loss, advantage, run, actor, learner, broker, replay, ray_settings,
        resources, env, log_settings, eval_plan,
        reward=reward, fault=fault,
    )  # fmt: skip


def start_parts(
    setup: Setup, out_dir: Path, started_ray: bool, num_actors: int | None = None
) -> Parts:
    """Start the queue, the actors (engines) and the learner ranks, then the broker.
    ``num_actors``: instead of ``actor.num_actors`` (0: the caller brings its own)."""
    import ray

    from asyncrl import startup_mark
    from asyncrl.actor.launch import new_actor
    from asyncrl.broker import make_broker
    from asyncrl.learner.config import start_learner
    from asyncrl.replay.queue import remote_queue

    queue = remote_queue(**setup.replay.buffer_kwargs(setup.learner.batch_groups))
    seed = setup.run.seed
    actors = {
        f"actor{i}": new_actor(
            setup.actor,
            setup.model_path,
            setup.task,
            queue,
            f"actor{i}",
            seed + 1000 * i,
            env=setup.env,
        )
        for i in range(setup.actor.num_actors if num_actors is None else num_actors)
    }
    from asyncrl.rewards.pool import RewardClient, start_workers

    reward_workers = start_workers(setup.reward)  # none on the fast path (task reward only)
    client = RewardClient(setup.reward, reward_workers)
    # set before start (the runner is built with it); waited for: an async actor may
    # run its calls out of order
    ray.get([a.set_rewards.remote(client) for a in actors.values()])
    # the engines (~25 s each on a CPU) start while the learner ranks load the model
    started = [a.start.remote() for a in actors.values()]
    learner = start_learner(
        setup.learner, setup.model_path, setup.loss, setup.advantage, setup.actor.sampling,
        seed, setup.run.max_steps, trajectory_log=setup.log.spec(out_dir),
    )  # fmt: skip
    startup_mark("learner_started")
    ray.get(started)  # engines up
    startup_mark("engines_up")
    moved = keep_off_engines(
        [s["placement"] for s in ray.get([a.get_stats.remote() for a in actors.values()])]
    )
    learner.ping()
    startup_mark("learner_up")
    broker = make_broker(setup.broker, actors, learner)
    startup_mark("broker_up")  # the actors primed with version 0
    parts = Parts(queue, actors, learner, broker, started_ray, moved)
    parts.reward_workers = reward_workers  # stopped with the actors (stop_parts)
    parts.supervisor = supervise(
        setup, parts, client, {n: seed + 1000 * i for i, n in enumerate(actors)}
    )
    return parts


def supervise(setup: Setup, parts: Parts, rewards: Any, seeds: dict[str, int]) -> Any:
    """The dead-actor supervisor (asyncrl/fault/actors.py); None with
    fault.actor_restarts=0 (a dead actor stays dead, as before)."""
    import ray

    from asyncrl.actor.launch import new_actor
    from asyncrl.fault.actors import ActorSupervisor

    if not setup.fault.actor_restarts or not parts.actors:
        return None

    def spawn(name: str, seed: int) -> Any:  # as above, one actor
        a = new_actor(setup.actor, setup.model_path, setup.task, parts.queue, name, seed,
                      env=setup.env)  # fmt: skip
        ray.get(a.set_rewards.remote(rewards))
        return a

    return ActorSupervisor(setup.fault, parts, spawn, seeds)


class StartupClock:
    """The run's metrics sink, passed through; the first step it logs ends the start-up:
    ``startup_seconds`` is ``asyncrl``'s import (the run's own imports included) to that moment."""

    def __init__(self, sink: Any):
        self.sink = sink
        self.first_step_at: float | None = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.first_step_at is None:
            from asyncrl import startup_mark

            self.first_step_at = time.time()
            startup_mark("first_step", self.first_step_at)  # == startup_seconds()
        self.sink.log(step, metrics)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sink, name)

    def startup_seconds(self) -> float | None:
        import asyncrl

        if self.first_step_at is None:
            return None
        return round(self.first_step_at - asyncrl.STARTED_AT, 2)


def keep_off_engines(placements: list[dict[str, Any]]) -> dict[int, set[int]]:
    """``actor.engine_cores`` are the engines' alone: every other thread below this
    driver (a local Ray's GCS, raylet, queue, learner and idle workers, the processes
    they start later, and another actor's frontend) moves to the other cores, so none
    of them interrupts a forward pass. The engines' own threads may only run on their
    cores and stay. ``placements``: the actors' ``get_stats()["placement"]`` ({}
    without engine_cores). Processes on other nodes, or of a Ray this driver joined,
    are not its descendants and stay as they are. Returns the moved threads' former
    affinities (``stop_parts`` gives them back: a Ray that outlives the run, as in
    the benchmarks, is not left narrowed)."""
    cores = set().union(*(p.get("engine_cores", ()) for p in placements))
    if not cores:
        return {}
    moved = keep_off(cores, os.getpid())
    log.info(
        "actor.engine_cores %s: %d threads of other processes moved off them",
        sorted(cores),
        len(moved),
    )
    return moved


def stop_parts(parts: Parts, quiet: bool = False) -> tuple[dict, dict]:
    """Close the broker (it finishes the sync in flight and closes its groups), stop the
    actors (nothing new is produced), then read the final accounting and close the
    learner. ``quiet``: log what fails instead of raising (shutting down after an error).
    Returns (queue stats, actor stats)."""
    import ray

    if parts.broker is not None:
        try:
            parts.broker.close()
        except Exception as e:
            if not quiet:
                raise
            log.warning("weight broker did not close cleanly: %s", e)
        parts.broker = None
    actor_stats: dict[str, Any] = {}
    if getattr(parts, "supervisor", None) is not None:
        parts.supervisor.close()  # actors still starting after a death: killed
    for name, a in list(parts.actors.items()):
        try:
            actor_stats[name] = ray.get(a.stop.remote(), timeout=60)
        except Exception as e:
            actor_stats[name] = f"stop failed: {type(e).__name__}: {e}"
            if not quiet:
                log.warning("actor %s did not stop cleanly: %s", name, e)
        # free its CPUs now: a second run in the same Ray (benchmarks) must fit
        ray.kill(a, no_restart=True)
    parts.actors.clear()
    from asyncrl.rewards.pool import stop_workers

    stop_workers(getattr(parts, "reward_workers", []))  # after the actors: none scores now
    restore(parts.moved_affinity)  # the engines are gone: their cores are everyone's again
    parts.moved_affinity = {}
    queue_stats: dict[str, Any] = {}
    try:
        ray.get(parts.queue.close.remote(), timeout=10)
        queue_stats = ray.get(parts.queue.stats.remote(), timeout=10)
    except Exception as e:
        if not quiet:
            raise
        log.warning("queue unreachable at shutdown: %s", e)
    try:
        parts.learner.close()
    except Exception as e:
        if not quiet:
            raise
        log.warning("learner unreachable at shutdown: %s", e)
    return queue_stats, actor_stats
