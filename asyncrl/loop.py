"""The training loop: the one loop every entry point runs (``asyncrl-train``, the
staleness and throughput benchmarks), with small hooks for what they vary.

    step V:  supervise                         dead actors replaced (asyncrl/fault/actors.py),
             │                                 here, before the publish, each wait poll
             batch = queue.get_batch(V)        waits for a batch; a dead or silent run
             │                                 raises with every actor's state
             learner.submit_train_step(batch)  ║ meanwhile: queue and actor stats (one
             │                                 ║ round of concurrent calls), then
             │                                 ║ hooks.during_step(V)
             metrics = the step's result
             broker.publish(V+1)               the sync runs in the background ...
             hooks.wait_for_sync: broker.wait()  ... unless every step waits for it
             queue.set_learner_version(V+1)    the staleness window moves on
             steer.observe(V+1, metrics)       replay.max_staleness=auto: the bound
             └▶ queue.set_max_staleness          moves when is/ess, is/mismatch_kl say so
             alerts (hooks.monitor); log metrics; checkpoint every ``learner.checkpoint_every``

Only ObjectRefs and small metadata pass through the driver: trajectories go from the
actors to the learner ranks through Ray's object store, weights from the learner to the
actors through the broker. The parts and what the loop calls on each: asyncrl/parts.py.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from asyncrl.learner.resume import save_checkpoint
from asyncrl.parts import Fleet, Parts
from asyncrl.replay.settings import AUTO, ReplaySettings
from asyncrl.replay.steer import StalenessSteer

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from ray import ObjectRef

log = logging.getLogger(__name__)

# How long one get_batch call may wait in the queue before the driver looks at the
# actors' health: short enough to notice a dead actor in seconds.
BATCH_POLL_S = 5.0
# A stats call that takes longer than this counts the actor as unreachable.
STATS_TIMEOUT_S = 10.0
# Where a step's seconds go: waiting for a batch, training, publishing the weights.
PHASES = ("wait", "train", "publish")
# A step's mean reward of one task's trajectories (learner/metrics.py), by task name
TASK_REWARD = "reward/task/"


class RunError(RuntimeError):
    """The run cannot go on (no batch, every actor dead); the message says why."""


class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...


class HealthCheck(Protocol):
    """Run-health alerts (asyncrl.monitor.HealthMonitor)."""

    def check(self, step: int, metrics: dict[str, float]) -> dict[str, float]: ...


class Evaluation(Protocol):
    """Held-out evaluation beside the run (asyncrl.eval.driver.Evaluator)."""

    skipped: list[int]  # versions whose evaluation was skipped (one still running)

    def step(self, version: int) -> dict[str, float]: ...

    def finish(self) -> dict[str, float]: ...

    def summary(self) -> dict[str, Any]: ...


@dataclass
class LoopHooks:
    """What the benchmarks vary; the defaults are the training job's loop."""

    # Runs while the learner trains on version V's batch (argument: V). The staleness
    # benchmark waits here until the actors made every group of version V.
    during_step: Callable[[int], None] | None = None
    # Every weight sync finishes before the next batch is asked for (synchronous
    # baseline, exact-delay staleness).
    wait_for_sync: bool = False
    # A checkpoint every N steps into this directory (N = learner.checkpoint_every).
    checkpoint_dir: Path | None = None
    progress: bool = False
    # ``check(step, metrics)`` adds ``alerts/*`` to each step's metrics and warns once
    # when one starts firing.
    monitor: HealthCheck | None = None
    # Every periodic checkpoint also copied to checkpoints/step-V (log.keep_checkpoints).
    keep_checkpoints: bool = False
    # ``step(V)`` starts an evaluation every eval.every versions when its actor is idle
    # and returns ``eval/*`` as they arrive.
    evaluator: Evaluation | None = None
    # Asked before each step: True ends the loop there (SIGINT/SIGTERM of the driver).
    should_stop: Callable[[], bool] | None = None


@dataclass
class LoopResult:
    steps: int
    policy_version: int
    per_step: list[tuple[float, float]] = field(default_factory=list)  # (reward sum, count)
    # task name -> its mean reward in each step that trained it (``reward/task/<name>``)
    per_task: dict[str, list[float]] = field(default_factory=dict)
    tokens_trained: int = 0
    # seconds over the whole loop, per PHASES
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))


def run_loop(
    cfg: DictConfig,
    parts: Parts,
    sink: MetricsSink,
    version: int = 0,
    hooks: LoopHooks | None = None,
) -> LoopResult:
    """Train from ``version`` up to ``cfg.max_steps`` policy versions."""
    hooks = hooks or LoopHooks()
    bar = _progress_bar(cfg.max_steps, version, hooks.progress)
    out = LoopResult(steps=0, policy_version=version)
    steer = steer_of(cfg)
    t0 = time.time()
    for _ in range(cfg.max_steps - version):  # a resumed run continues up to max_steps
        if hooks.should_stop is not None and hooks.should_stop():
            break
        m, stats, seconds = train_step(cfg, parts, version, hooks)
        version += 1
        for k, v in seconds.items():
            out.phases[k] += v
        out.per_step.append((m["reward/sum"], m["reward/count"]))
        for k, v in m.items():
            if k.startswith(TASK_REWARD):
                out.per_task.setdefault(k[len(TASK_REWARD) :], []).append(v)
        out.tokens_trained += int(m["tokens/trained"])
        m.update(progress_metrics(stats, t0, out.tokens_trained, out.phases))
        if steer is not None:
            steer_bound(parts, steer, version, m)
        m.update(_watched(parts, hooks, version, m))
        sink.log(version, m)
        _checkpoint(cfg, parts, hooks, version)
        _show(bar, m)
    bar.close()
    out.steps, out.policy_version = len(out.per_step), version
    if parts.broker is not None:
        parts.broker.wait()
    return out


def train_step(
    cfg: DictConfig, parts: Parts, version: int, hooks: LoopHooks
) -> tuple[dict[str, float], dict[str, ObjectRef], dict[str, float]]:
    """One policy version: a batch at ``version``, the learner's step on it, the weights
    published as ``version + 1``. Returns the step's metrics, the stats calls answered
    meanwhile (for :func:`progress_metrics`) and the seconds of each of PHASES."""
    import ray

    broker = parts.broker
    if broker is None:
        raise RunError("the weight broker is closed: these parts were stopped")
    supervise(parts)  # dead actors noticed each step too, while batches still come
    t = time.time()
    items = wait_batch(parts, cfg.learner.batch_groups, version, cfg.replay.wait_timeout_s)
    t_batch = time.time()
    step = parts.learner.submit_train_step(items, version)
    stats = _stats_refs(parts)  # answered while the learner trains
    if hooks.during_step is not None:
        hooks.during_step(version)
    m = ray.get(step)
    t_trained = time.time()
    # and before the publish: a sync must not start to an engine that died during
    # the step (the learner's sender would wait broker.timeout_s for it)
    supervise(parts)
    m.update(broker.publish(version + 1))
    if hooks.wait_for_sync:
        m.update(broker.wait())
    parts.queue.set_learner_version.remote(version + 1)
    seconds = dict(zip(PHASES, (t_batch - t, t_trained - t_batch, time.time() - t_trained)))
    m.update({f"perf/{k}_seconds": v for k, v in seconds.items()})
    return m, stats, seconds


def steer_of(cfg: DictConfig) -> StalenessSteer | None:
    """The steer of ``replay.max_staleness=auto`` (its keys checked as at start-up); None
    for a fixed bound. It starts at ``replay.auto_floor``, as the queue does."""
    if cfg.replay.get("max_staleness") != AUTO:
        return None
    return StalenessSteer.from_settings(ReplaySettings.from_config(cfg.replay))


def steer_bound(parts: Parts, steer: StalenessSteer, version: int, m: dict[str, float]) -> None:
    """The step that published ``version`` fed to the steer; a change it decides is
    logged (one line, with its reason) and sent to the queue, not awaited (as
    ``set_learner_version``): whatever bound is in force when the queue hands out a
    batch is the one it enforces, so no sample ever leaves staler than it."""
    change = steer.observe(version, m)
    if change is None:
        return
    log.info("replay.max_staleness %s (step %d)", change.reason, change.step)
    parts.queue.set_max_staleness.remote(change)


def _watched(parts: Parts, hooks: LoopHooks, version: int, m: dict[str, float]) -> dict:
    """``fault/*``, ``eval/*`` and ``alerts/*`` of the step that published ``version``."""
    out: dict[str, float] = {}
    if parts.supervisor is not None:
        out.update(parts.supervisor.metrics())
    if hooks.evaluator is not None:  # never waits for the evaluation
        out.update(hooks.evaluator.step(version))
    if hooks.monitor is not None:  # the alerts see every other metric of the step
        out.update(hooks.monitor.check(version, {**m, **out}))
    return out


def _checkpoint(cfg: DictConfig, parts: Parts, hooks: LoopHooks, version: int) -> None:
    """Every ``learner.checkpoint_every`` versions, when the hooks name a directory."""
    every = cfg.learner.checkpoint_every
    if hooks.checkpoint_dir is None or not every or version % every:
        return
    # asyncrl-replay starts from kept steps (log.keep_checkpoints: keep them all)
    keep = 0 if hooks.keep_checkpoints else cfg.learner.checkpoint_keep
    save_checkpoint(parts, hooks.checkpoint_dir.parent, version, keep)


def wait_batch(parts: Parts, batch_groups: int, version: int, timeout_s: float) -> list:
    """A batch from the queue; raises (with every actor's state) instead of hanging."""
    import ray

    deadline = time.time() + timeout_s
    while True:
        items = ray.get(parts.queue.get_batch.remote(batch_groups, version, BATCH_POLL_S))
        if items:
            return items
        states = actor_states(parts)
        restarting = supervise(parts, states)
        if restarting:  # an engine start takes long: its time is not the batch's
            deadline = max(deadline, time.time() + timeout_s)
            continue
        alive = [n for n, s in states.items() if isinstance(s, dict) and not s.get("fatal")]
        if not alive or time.time() > deadline:
            why = (
                "no actor is alive"
                if not alive
                else f"no batch within replay.wait_timeout_s={timeout_s}"
            )
            raise RunError(f"{why}; queue: {ray.get(parts.queue.stats.remote())}; actors: {states}")


def supervise(parts: Parts, states: dict[str, Any] | None = None) -> bool:
    """Let the supervisor (asyncrl/fault/actors.py; none with fault.actor_restarts=0)
    look at the actors; raises once none is alive or coming back. Returns whether a
    restart is under way."""
    sup = parts.supervisor
    if sup is None:
        return False
    sup.poll(states)
    why = sup.hopeless()
    if why:
        import ray

        raise RunError(f"{why}; queue: {ray.get(parts.queue.stats.remote())}")
    return sup.restarting


def actor_states(parts: Parts | Fleet) -> dict[str, Any]:
    """Every actor's stats, asked of all at once; a dead or stuck actor is reported
    (a string saying why), not raised."""
    refs = {name: a.get_stats.remote() for name, a in parts.actors.items()}
    return _collect(refs)


def _collect(refs: dict[str, Any]) -> dict[str, Any]:
    import ray

    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=STATS_TIMEOUT_S)
    ready_set = set(ready)
    out: dict[str, Any] = {}
    for name, ref in refs.items():
        if ref not in ready_set:
            out[name] = f"unreachable: no answer within {STATS_TIMEOUT_S:g}s"
            continue
        try:
            out[name] = ray.get(ref)
        except Exception as e:  # noqa: BLE001 - a dead actor is a state, not an error here
            out[name] = f"unreachable: {type(e).__name__}: {e}"
    return out


def _stats_refs(parts: Parts) -> dict[str, Any]:
    refs = {f"actor:{n}": a.get_stats.remote() for n, a in parts.actors.items()}
    refs["queue"] = parts.queue.stats.remote()
    return refs


def progress_metrics(
    stats_refs: dict[str, Any], t0: float, tokens_trained: int, phases: dict[str, float]
) -> dict[str, float]:
    """Throughput and idle fractions from one round of concurrent stats calls."""
    got = _collect(stats_refs)
    q = got.pop("queue")
    if not isinstance(q, dict):
        raise RunError(f"the replay queue is unreachable: {q}")
    states = [s for s in got.values() if isinstance(s, dict)]
    now = time.time()
    wall = max(now - t0, 1e-9)
    idle = [s["idle_seconds"] / max(now - s["started"], 1e-9) for s in states]
    return {
        "replay/depth": q["depth_groups"],
        "replay/bound": q["max_staleness"],  # the bound this step's batch was taken under
        "replay/produced": q["produced"],
        "replay/in_flight": q["in_flight"],
        "staleness/dropped": q["dropped_stale"],
        "staleness/max_trained": q["max_staleness_trained"],
        "replay/groups_lost": q.get("groups_lost", 0),  # granted to actors that died
        "perf/tokens_per_s_generated": sum(s["tokens"] for s in states) / wall,
        "perf/tokens_per_s_trained": tokens_trained / wall,
        "perf/learner_idle_frac": phases["wait"] / wall,
        "perf/learner_busy_frac": phases["train"] / wall,
        "perf/actor_idle_frac": sum(idle) / max(len(idle), 1),
    }


def _progress_bar(total: int, initial: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        total=total, initial=initial, disable=not enabled, dynamic_ncols=True, file=sys.stderr
    )


def _show(bar: Any, m: dict[str, float]) -> None:
    bar.update(1)
    bar.set_postfix_str(
        f"reward {m['reward/mean']:.3f} stale {m['staleness/mean']:.2f}/"
        f"{int(m['staleness/max'])} tok/s {m.get('perf/tokens_per_s_generated', 0):.0f}"
    )
