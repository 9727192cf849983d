"""Build every part from config: ``prepare`` checks every component's settings and
builds what is cheap (in the driver, before Ray starts, so config errors surface at
once); ``start_parts`` starts the Ray actors; ``stop_parts`` stops them (the broker
included) without losing the accounting."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from asyncrl.actor.settings import ActorSettings
from asyncrl.broker.settings import BrokerKind, BrokerSettings
from asyncrl.config import ConfigError, Settings, build, setting, settings_from
from asyncrl.engine import sglang_engine
from asyncrl.engine.settings import TRANSFER_BACKEND, EngineBackend
from asyncrl.engine.split import check_model as check_engine_split
from asyncrl.engine.vllm_engine import on_cpu
from asyncrl.envs.settings import EnvSettings
from asyncrl.eval.launch import EvalPlan, prepare_eval
from asyncrl.eval.settings import EvalSettings
from asyncrl.fault.settings import FaultSettings
from asyncrl.learner.config import LearnerSettings
from asyncrl.learner.moe_check import check_model as check_experts
from asyncrl.learner.tensor_parallel import check_model
from asyncrl.models.resolve import resolve_model  # model.preset / path / tiny, checked
from asyncrl.parts import ActorHandle, Fleet, Parts, QueueHandle, Supervisor
from asyncrl.replay.settings import ReplaySettings
from asyncrl.rewards.settings import RewardSettings
from asyncrl.runtime import RaySettings
from asyncrl.tasks.base import Prompt, Task, TaskSampler
from asyncrl.tasks.sampler import SamplerSettings, with_sampler
from asyncrl.transport.reshard import check_family
from asyncrl.utils.affinity import keep_off, restore
from asyncrl.utils.cpu import slow_bf16_warning
from asyncrl.utils.runlog import LogSettings, Scalars

if TYPE_CHECKING:  # these import torch, which prepare() imports only once it builds them
    from asyncrl.losses.advantages import Advantage
    from asyncrl.losses.base import Loss
    from asyncrl.rewards.pool import RewardClient

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
    task: Task  # the training prompts (held-out ones split off, the sampler applied)
    loss: Loss
    advantage: Advantage
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


def build_task(cfg: DictConfig) -> Task:
    task = build("task", cfg.task)
    try:
        first = TaskSampler(task, cfg.seed).next()
        # a task whose env opens each prompt (env_prompt: the reset's observation) may
        # draw empty text
        if not isinstance(first, Prompt) or not (first.text or getattr(task, "env_prompt", False)):
            raise ValueError(f"the task's first prompt is not a Prompt with text: {first!r}")
    except Exception as e:
        raise ConfigError(
            f"task ({cfg.task.get('_target_')}): cannot draw a prompt: {type(e).__name__}: {e}"
        ) from e
    return task


def _checkpoint_keep(cfg: DictConfig) -> None:
    """``checkpoint.keep``, when set, is ``learner.checkpoint_keep`` (beside
    ``learner.checkpoint_every``): written through, so the loop, the restarts and the
    saved config.yaml see one value."""
    keep = (cfg.get("checkpoint") or {}).get("keep")
    if keep is None:
        return
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise ConfigError(f"checkpoint.keep={keep!r}: must be an integer >= 0 (0: keep all)")
    cfg.learner.checkpoint_keep = keep


def build_loss(cfg: DictConfig) -> Loss:
    """``loss._target_``: callable as ``loss(batch, outputs)``, declaring what it needs
    (``needs_proximal``, ``needs_values``: asyncrl/losses/base.py)."""
    from asyncrl.losses.base import Loss

    loss = build("loss", cfg.loss)
    if not isinstance(loss, Loss):
        missing = [n for n in ("needs_proximal", "needs_values") if not hasattr(loss, n)]
        why = f"it lacks {', '.join(missing)}" if missing else "it is not callable"
        raise ConfigError(
            f"loss._target_={cfg.loss._target_} is not a loss: {why} (a loss is called as "
            "loss(batch, outputs) and declares needs_proximal and needs_values)"
        )
    return loss


def _check_learner_fits(learner: LearnerSettings, actor: ActorSettings, ray: RaySettings) -> None:
    batch_size = learner.batch_groups * actor.sampling.n
    if learner.minibatches > batch_size:
        raise ConfigError(
            f"learner.minibatches={learner.minibatches} is more than the "
            f"{batch_size} trajectories of a batch (learner.batch_groups x actor.sampling.n)"
        )
    if learner.resources and not ray.address:
        raise ConfigError(
            f"learner.resources={learner.resources}: a local Ray (ray.address=null) has no "
            "custom resources to place the ranks by; set ray.address to a cluster whose "
            "nodes declare them (docs/cluster.md)"
        )


def _check_splits(
    model_path: str, learner: LearnerSettings, actor: ActorSettings, broker: BrokerSettings
) -> None:
    """The model splits as the learner's and the engines' layouts ask (and the road the
    weights take into the engines serves that split, and the engines' backend)."""
    check_model(model_path, learner.tp, learner.ep)  # learner.tp: a plan, whole heads per rank
    # a MoE model to split (learner.ep), to replay or to record the routes of
    check_experts(model_path, learner.ep, learner.moe.routing_replay, actor.record_experts)
    check_engine_split(model_path, actor.engine.tensor_parallel_size)  # whole heads per worker
    _check_reshard(model_path, learner, actor, broker)
    _engine_api(actor, broker)  # vLLM's update API: whole tensors to every worker
    check_engine_backend(actor, broker)  # SGLang: what it serves, and whether it imports


def _check_reshard(model_path: str, learner: LearnerSettings, actor: ActorSettings,
                   broker: BrokerSettings) -> None:  # fmt: skip
    """``broker.reshard`` with a tensor-parallel engine on the process-group broker: the
    resharding plan knows the model's layout, the engine cuts experts by width (no
    expert parallelism), and the learner sends whole weights."""
    tp = actor.engine.tensor_parallel_size
    if not broker.reshard or tp == 1 or broker.kind != BrokerKind.GLOO:
        return
    fix = "set broker.reshard=false (every worker then gets the full tensors)"
    if learner.lora.rank:
        raise ConfigError(
            f"broker.reshard=true with actor.engine.tensor_parallel_size={tp}: learner.lora "
            f"sends adapters, which the engine merges into whole weights; {fix}"
        )
    if actor.engine.extra.get("enable_expert_parallel"):
        raise ConfigError(
            f"broker.reshard=true with actor.engine.tensor_parallel_size={tp} and actor."
            "engine.extra.enable_expert_parallel=true: the engine splits whole experts over its "
            f"ranks, the plan cuts each expert's width; {fix}"
        )
    config = json.loads((Path(model_path) / "config.json").read_text())
    why = check_family(config, tp, cpu=on_cpu())
    if why is not None:
        raise ConfigError(
            f"broker.reshard=true with actor.engine.tensor_parallel_size={tp}: {why}; {fix}"
        )


def _engine_api(actor: ActorSettings, broker: BrokerSettings) -> None:
    """``broker.engine_api=vllm``: the actors' engines start with asyncrl's vLLM
    weight-transfer backend (asyncrl/engine/vllm_transfer.py), whose update sends every
    worker the whole model: a resharded sync stays on asyncrl's path."""
    if broker.kind != BrokerKind.GLOO or broker.engine_api != "vllm":
        return
    tp = actor.engine.tensor_parallel_size
    if broker.reshard and tp > 1:
        raise ConfigError(
            f"broker.engine_api=vllm with broker.reshard=true and actor.engine."
            f"tensor_parallel_size={tp}: vLLM's update API gets whole tensors; set "
            "broker.reshard=false or broker.engine_api=asyncrl"
        )
    wanted = {"backend": TRANSFER_BACKEND}
    have = actor.engine.extra.setdefault("weight_transfer_config", wanted)
    if have != wanted:
        raise ConfigError(
            f"actor.engine.extra.weight_transfer_config={have!r} with broker.engine_api=vllm: "
            f"asyncrl's broker drives {wanted!r}; drop the extra key"
        )


def check_engine_backend(actor: ActorSettings, broker: BrokerSettings) -> None:
    """``actor.engine.backend=sglang``: what SGLangEngine (asyncrl/engine/sglang_engine.py)
    cannot serve is refused here, then an SGLang this Python cannot import."""
    if actor.engine.backend != EngineBackend.SGLANG:
        return
    key = "actor.engine.backend=sglang"
    if broker.kind != BrokerKind.OBJECTSTORE:
        raise ConfigError(
            f"{key} with broker={broker.kind.value}: the process-group broker's receivers "
            "are vLLM workers (asyncrl's worker extension, or vLLM's weight-transfer API); "
            "SGLang takes weights through its update_weights_from_tensor: set "
            "broker=objectstore"
        )
    if actor.record_experts:
        raise ConfigError(
            f"{key} with actor.record_experts=true: the routed experts are recorded by "
            "asyncrl's vLLM worker extension; set actor.record_experts=false "
            "(learner.moe.routing_replay=false)"
        )
    if actor.engine_cores is not None:
        raise ConfigError(
            f"{key} with actor.engine_cores={actor.engine_cores!r}: the placement moves "
            "vLLM's engine-core threads; set actor.engine_cores=null"
        )
    s = actor.sampling
    if s.top_p < 1 or s.top_k > 0:
        raise ConfigError(
            f"{key} with actor.sampling.top_p={s.top_p}, top_k={s.top_k}: SGLang's "
            "output_token_logprobs are of the temperature-scaled distribution before "
            "top-p/top-k (its sampler.py), not of the one sampled from; set "
            "actor.sampling.top_p=1.0 and top_k=0"
        )
    if not sglang_engine.importable():
        raise ConfigError(
            f"{key}: this Python cannot import sglang (docs/engines.md, SGLang: its PyPI "
            "kernels need CUDA, its CPU build an AMX Xeon); install it or set "
            "actor.engine.backend=vllm"
        )


def cpu_bf16_keys(cfg: DictConfig) -> list[str]:
    """The settings that compute in bf16 on a CPU: the tiny model's warm start (built in
    this process), and the learner's autocast and the engine's dtype on ranks and actors
    given no GPU."""
    keys = []
    model = cfg.get("model") or {}
    if not model.get("path") and (model.get("tiny") or {}).get("warm_start_bf16"):
        keys.append("model.tiny.warm_start_bf16")
    if cfg.learner.get("autocast") == "bfloat16" and not cfg.learner.get("num_gpus"):
        keys.append("learner.autocast")
    engine = cfg.actor.get("engine") or {}
    if engine.get("dtype") == "bfloat16" and not cfg.actor.get("num_gpus"):
        keys.append("actor.engine.dtype")
    return keys


def model_for(cfg: DictConfig, task: Any) -> str:
    """The run's model directory (built if need be), after one line where the run would
    compute in bf16 on a CPU that has no native bf16 (the warm start is built here)."""
    if warning := slow_bf16_warning(cpu_bf16_keys(cfg)):
        log.warning(warning)
    return resolve_model(cfg, task)


def prepare(cfg: DictConfig) -> Setup:
    """Check every component's settings and build the cheap parts, in the driver before
    Ray starts: every config error surfaces here as one ConfigError naming its key.
    Settings first (cheap, pure Python), then what imports torch, then the model."""
    top = {k: cfg.get(k) for k in ("max_steps", "seed", "resume", "progress")}
    run = settings_from(RunSettings, top, "")
    ray_settings = RaySettings.from_config(cfg.ray)
    actor = ActorSettings.from_config(cfg.actor)
    replay = ReplaySettings.from_config(cfg.replay)
    broker = BrokerSettings.from_config(cfg.broker)
    task = build_task(cfg)
    env = EnvSettings.from_config(cfg.get("env"), cfg.get("sandbox"), task)  # env=code: sandbox.*
    log_settings = LogSettings.from_config(cfg.get("log"))
    reward = RewardSettings.from_config(cfg.get("reward"))
    fault = FaultSettings.from_config(cfg.get("fault"))
    evaluation = EvalSettings.from_config(cfg.get("eval"))
    sampler = SamplerSettings.from_config(cfg.get("sampler"))
    loss = build_loss(cfg)
    _checkpoint_keep(cfg)
    learner = LearnerSettings.from_config(cfg.learner, loss, run.max_steps)
    advantage = build("learner.advantage", cfg.learner.advantage)
    _check_learner_fits(learner, actor, ray_settings)
    if run.resume:
        from asyncrl.learner.resume import check_resume

        check_resume(run.resume)
    model_path = model_for(cfg, task)
    env.check_template(model_path)  # a message-level env: its chat template, append-only
    actor = actor.recording(learner.moe.routing_replay)  # actor.record_experts: null follows
    _check_splits(model_path, learner, actor, broker)
    if learner.lora.on:  # learner.lora: layers the model has (the check imports torch)
        from asyncrl.learner.lora import check_targets

        check_targets(model_path, learner.lora)
    # with eval.every > 0: the held-out sets, and the training task without their prompts
    eval_plan, task = prepare_eval(evaluation, task)
    task = with_sampler(task, sampler)  # how the actors draw prompts (sampler=adaptive)
    resources = {
        "actors": actor.num_actors * actor.num_cpus,
        "learner": learner.world_size * learner.num_cpus,
        "eval": evaluation.num_cpus if evaluation.enabled else 0,
    }
    return Setup(
        model_path=model_path,
        task=task,
        loss=loss,
        advantage=advantage,
        run=run,
        actor=actor,
        learner=learner,
        broker=broker,
        replay=replay,
        ray=ray_settings,
        resources=resources,
        env=env,
        log=log_settings,
        evaluation=eval_plan,
        reward=reward,
        fault=fault,
    )


def start_parts(
    setup: Setup, out_dir: Path, started_ray: bool, num_actors: int | None = None
) -> Parts:
    """Start the queue, the actors (engines), the reward workers and the learner ranks,
    then the broker and the actors' supervisor. ``num_actors``: instead of
    ``actor.num_actors`` (0: the caller brings its own)."""
    import ray

    from asyncrl import startup_mark
    from asyncrl.broker import spawn_broker
    from asyncrl.learner.group import start_learner
    from asyncrl.replay.queue import remote_queue
    from asyncrl.rewards.pool import RewardClient, launch_workers

    queue = remote_queue(**setup.replay.buffer_kwargs(setup.learner.batch_groups))
    n = setup.actor.num_actors if num_actors is None else num_actors
    seeds = {f"actor{i}": setup.run.seed + 1000 * i for i in range(n)}
    actors = {name: _new_actor(setup, queue, name, seed) for name, seed in seeds.items()}
    # none on the fast path (task reward only); built while the engines start
    reward_workers, rewards_built = launch_workers(setup.reward)
    rewards = RewardClient(setup.reward, reward_workers)
    # set before start (the runner is built with it); waited for: an async actor may
    # run its calls out of order
    ray.get([a.set_rewards.remote(rewards) for a in actors.values()])
    # the engines (~25 s each on a CPU) start while the learner ranks load the model
    started = [a.start.remote() for a in actors.values()]
    learner = start_learner(
        setup.learner,
        setup.model_path,
        setup.loss,
        setup.advantage,
        setup.actor.sampling,
        setup.run.seed,
        setup.run.max_steps,
        trajectory_log=setup.log.spec(out_dir),
    )
    startup_mark("learner_started")
    start_broker = spawn_broker(setup.broker, actors, learner)  # its process loads meanwhile
    ray.get(rewards_built + started)  # reward workers built, engines up
    startup_mark("engines_up")
    stats = ray.get([a.get_stats.remote() for a in actors.values()])
    moved = keep_off_engines([s["placement"] for s in stats])
    learner.ping()
    startup_mark("learner_up")
    broker = start_broker()
    startup_mark("broker_up")  # the actors primed with version 0
    supervisor = supervise(setup, Fleet(queue, actors, broker), rewards, seeds)
    return Parts(
        queue=queue,
        actors=actors,
        learner=learner,
        broker=broker,
        started_ray=started_ray,
        supervisor=supervisor,
        reward_workers=reward_workers,
        moved_affinity=moved,
    )


def _new_actor(setup: Setup, queue: QueueHandle, name: str, seed: int) -> ActorHandle:
    """A rollout actor (not started, its rewards not set) on ``queue``."""
    from asyncrl.actor.launch import new_actor

    return new_actor(setup.actor, setup.model_path, setup.task, queue, name, seed, env=setup.env)


def supervise(
    setup: Setup, fleet: Fleet, rewards: RewardClient, seeds: dict[str, int]
) -> Supervisor | None:
    """The dead-actor supervisor of ``fleet`` (asyncrl/fault/actors.py); None with
    fault.actor_restarts=0 (a dead actor stays dead) or without actors."""
    import ray

    from asyncrl.fault.actors import ActorSupervisor

    if not setup.fault.actor_restarts or not fleet.actors:
        return None

    def spawn(name: str, seed: int) -> ActorHandle:  # as start_parts does, one actor
        a = _new_actor(setup, fleet.queue, name, seed)
        ray.get(a.set_rewards.remote(rewards))
        return a

    return ActorSupervisor(setup.fault, fleet, spawn, seeds)


class StartupClock:
    """The run's metrics sink, passed through; the first step it logs ends the start-up:
    ``startup_seconds`` is ``asyncrl``'s import (the run's own imports included) to that moment."""

    def __init__(self, sink: Scalars):
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
    actors (nothing new is produced) and the reward workers, then read the final
    accounting and close the learner. ``quiet``: log what fails instead of raising
    (shutting down after an error). Returns (queue stats, actor stats)."""
    import ray

    from asyncrl.rewards.pool import stop_workers

    if parts.broker is not None:
        _closing("weight broker", parts.broker.close, quiet)
        parts.broker = None
    actor_stats = _stop_actors(parts, quiet)
    stop_workers(parts.reward_workers)  # after the actors: none scores now
    parts.reward_workers = []
    restore(parts.moved_affinity)  # the engines are gone: their cores are everyone's again
    parts.moved_affinity = {}
    queue_stats: dict[str, Any] = {}

    def close_queue() -> None:
        ray.get(parts.queue.close.remote(), timeout=10)
        queue_stats.update(ray.get(parts.queue.stats.remote(), timeout=10))

    _closing("queue", close_queue, quiet)
    _closing("learner", lambda: parts.learner.close(), quiet)
    return queue_stats, actor_stats


def _stop_actors(parts: Parts, quiet: bool) -> dict[str, Any]:
    """Every actor's final stats (or why it did not stop); their processes killed."""
    import ray

    if parts.supervisor is not None:
        parts.supervisor.close()  # actors still starting after a death: killed
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
    return actor_stats


def _closing(what: str, close: Callable[[], None], quiet: bool) -> None:
    """``close()``; what it raises is raised, or with ``quiet`` logged."""
    try:
        close()
    except Exception as e:
        if not quiet:
            raise
        log.warning("%s did not close cleanly: %s", what, e)
