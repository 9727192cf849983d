"""Build every part from config: ``prepare`` checks and builds what is cheap (in the
driver, before Ray starts, so config errors surface at once); ``start_parts`` starts
the Ray actors; ``stop_parts`` stops them without losing the accounting."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from asyncrl.broker.settings import BROKERS, check_broker_config  # noqa: F401 (BROKERS: re-export)
from asyncrl.config import ConfigError, build, check_model_dir
from asyncrl.runtime import Parts
from asyncrl.utils.affinity import keep_off, restore

log = logging.getLogger(__name__)


@dataclass
class Setup:
    model_path: str
    task: Any
    loss: Any
    advantage: Any
    resources: dict[str, float] = field(default_factory=dict)


def resolve_model(cfg: DictConfig, task: Any) -> str:
    if cfg.model.path:
        return str(check_model_dir(cfg.model.path))
    from asyncrl.models.tiny import TinyModelSpec, ensure_tiny_model

    if not hasattr(task, "alphabet"):
        raise ConfigError(
            "model.path is null (tiny model) but the task has no `alphabet` to build a tokenizer from"
        )
    try:
        spec = TinyModelSpec(**OmegaConf.to_container(cfg.model.tiny, resolve=True))
    except TypeError as e:
        raise ConfigError(f"model.tiny: {e}") from e
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return str(ensure_tiny_model(task, spec, cfg.model.cache_dir))


def prepare(cfg: DictConfig) -> Setup:
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
    loss = build("loss", cfg.loss)
    if not callable(loss):
        raise ConfigError(
            f"loss._target_={cfg.loss._target_} is not callable as loss(batch, outputs)"
        )
    advantage = build("learner.advantage", cfg.learner.advantage)
    check_broker_config(cfg.broker)  # broker.kind in BROKERS, and every broker.* setting
    from asyncrl.learner.config import check_learner_config, check_resume

    check_learner_config(cfg.learner, loss, cfg.max_steps)  # world size, budgets, value head
    if cfg.resume:
        check_resume(cfg.resume)
    for key in ("max_steps", "learner.batch_groups", "actor.num_actors", "actor.sampling.n"):
        if OmegaConf.select(cfg, key) < 1:
            raise ConfigError(f"{key} must be >= 1, got {OmegaConf.select(cfg, key)}")
    batch_size = cfg.learner.batch_groups * cfg.actor.sampling.n
    if cfg.learner.minibatches > batch_size:
        raise ConfigError(
            f"learner.minibatches={cfg.learner.minibatches} is more than the "
            f"{batch_size} trajectories of a batch (learner.batch_groups x actor.sampling.n)"
        )
    model_path = resolve_model(cfg, task)
    resources = {
        "actors": cfg.actor.num_actors * cfg.actor.num_cpus,
        "learner": cfg.learner.world_size * cfg.learner.num_cpus,
    }
    return Setup(model_path, task, loss, advantage, resources)


def start_parts(cfg: DictConfig, setup: Setup, out_dir: Path, started_ray: bool) -> Parts:
    import ray

    from asyncrl.actor.rollout import SamplingSettings
    from asyncrl.broker.client import make_broker
    from asyncrl.learner.config import start_learner
    from asyncrl.replay.queue import remote_queue

    rp = cfg.replay
    queue = remote_queue(
        max_staleness=rp.max_staleness,
        batch_groups=cfg.learner.batch_groups,
        policy=rp.policy,
        max_reuse=rp.max_reuse,
        capacity_groups=rp.capacity_groups,
        delay_versions=rp.delay_versions,
    )
    sampling = SamplingSettings(**OmegaConf.to_container(cfg.actor.sampling, resolve=True))
    actors = {
        f"actor{i}": new_actor(cfg, setup, queue, f"actor{i}", cfg.seed + 1000 * i)
        for i in range(cfg.actor.num_actors)
    }
    learner = start_learner(  # a LearnerGroup: N ranks, same methods as one Learner actor
        cfg.learner, setup.model_path, setup.loss, setup.advantage, sampling, cfg.seed,
        cfg.max_steps, trajectory_log=str(out_dir / "trajectories.parquet"),
    )  # fmt: skip
    ray.get([a.start.remote() for a in actors.values()])  # engines up (~25 s each on a CPU)
    moved = keep_off_engines(
        [s["placement"] for s in ray.get([a.get_stats.remote() for a in actors.values()])]
    )
    ray.get(learner.ping.remote())
    broker = make_broker(cfg.broker, actors, learner)  # objectstore | gloo (process group)
    return Parts(queue, actors, learner, broker, started_ray, moved)


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


def new_actor(cfg: Any, setup: Any, queue: Any, name: str, seed: int, cls: Any = None):
    """A RolloutActor (or subclass ``cls``) as a Ray actor, from ``cfg.actor``; not
    started (call ``start``)."""
    import ray
    from omegaconf import OmegaConf

    from asyncrl.actor.engine import EngineSettings
    from asyncrl.actor.rollout import RolloutActor, SamplingSettings

    a = cfg.actor
    return (
        ray.remote(cls or RolloutActor)
        .options(num_cpus=a.num_cpus, max_concurrency=1000)
        .remote(
            name,
            setup.model_path,
            setup.task,
            queue,
            SamplingSettings(**OmegaConf.to_container(a.sampling, resolve=True)),
            EngineSettings(**OmegaConf.to_container(a.engine, resolve=True)),
            seed=seed,
            max_inflight_groups=a.max_inflight_groups,
            update_mode=a.update_mode,
            handoff_linger_s=a.handoff_linger_ms / 1000,
            engine_cores=a.get("engine_cores"),
        )
    )


def stop_parts(parts: Parts, checkpoint_dir: Path | None, quiet: bool = False) -> tuple[dict, dict]:
    """Stop actors first (nothing new is produced), then read the final accounting."""
    import ray

    actor_stats: dict[str, Any] = {}
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
        if checkpoint_dir is not None:
            ray.get(parts.learner.save.remote(str(checkpoint_dir)), timeout=300)
        ray.get(parts.learner.close.remote(), timeout=60)
    except Exception as e:
        if not quiet:
            raise
        log.warning("learner unreachable at shutdown: %s", e)
    return queue_stats, actor_stats
