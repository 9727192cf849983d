"""The driver's half of checkpoint and resume.

    save:   queue accounting + every actor's task-sampler state ─▶ learner.save(PATH, that)
    resume: learner.load(PATH) ─▶ version V, driver state ─▶ queue accounting and samplers
            restored ─▶ weights of V published to the actors ─▶ the loop continues at V

Queued trajectories are ObjectRefs of the old run and die with it: a resumed run counts
what was queued at the checkpoint as dropped, so ``produced == trained + dropped +
in_queue`` still holds. The queue and the actors are reached through Ray's
``__ray_call__`` (they keep their state in ``buf`` and ``sampler``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Accounting counters summed when the saved run and the resumed one meet.
ADDITIVE = (
    "produced", "trained", "dropped_stale", "samples_trained", "groups_started", "groups_dropped",
)  # fmt: skip


def _sampler_state(actor: Any) -> dict:
    return actor.sampler.state_dict()


def _load_sampler(actor: Any, state: dict) -> None:
    actor.sampler.load_state_dict(state)


def _load_queue(queue: Any, state: dict) -> dict:
    """Restore the accounting into the live queue. The actors started before the load, so
    what this run counted so far is added on top; what was queued or generating at the
    checkpoint is lost: its trajectories count as dropped, and its groups leave the
    throttle window (the old run keeps exactly the ``V * batch_groups`` it trained)."""
    import dataclasses

    buf = queue.buf
    live = dataclasses.replace(buf.acc)
    saved = state["acc"]
    lost = saved["produced"] - saved["trained"] - saved["dropped_stale"]
    buf.load_state_dict(state, lost_in_queue=lost)
    acc = buf.acc
    for f in ADDITIVE:
        setattr(acc, f, getattr(acc, f) + getattr(live, f))
    acc.groups_running = live.groups_running
    outstanding = saved["groups_started"] - saved["groups_dropped"]
    acc.groups_dropped += max(0, outstanding - state["learner_version"] * buf.batch_groups)
    acc.max_staleness_trained = max(acc.max_staleness_trained, live.max_staleness_trained)
    for k, v in live.staleness_hist.items():
        acc.staleness_hist[k] = acc.staleness_hist.get(k, 0) + v
    return buf.stats()


def driver_state(parts: Any) -> dict[str, Any]:
    import ray

    names = list(parts.actors)
    samplers = ray.get([parts.actors[n].__ray_call__.remote(_sampler_state) for n in names])
    return {
        "queue": ray.get(parts.queue.state_dict.remote()),
        "samplers": dict(zip(names, samplers)),
    }


def save_checkpoint(parts: Any, path: Path) -> str:
    """Learner state (sharded) plus the driver's state, in one checkpoint directory."""
    import ray

    return ray.get(parts.learner.save.remote(str(path), driver_state(parts)))


def resume(parts: Any, path: str) -> int:
    """Continue from ``path``; returns the policy version the run continues from."""
    import ray

    meta = ray.get(parts.learner.load.remote(path))
    version = int(meta["version"])
    ds = meta.get("driver_state") or {}
    if "queue" in ds:
        ray.get(parts.queue.__ray_call__.remote(_load_queue, ds["queue"]))
    for name, state in ds.get("samplers", {}).items():
        if name in parts.actors:
            ray.get(parts.actors[name].__ray_call__.remote(_load_sampler, state))
    weights = ray.get(parts.learner.state_dict_ref.remote())
    parts.broker.publish(version, weights)
    parts.broker.wait()
    ray.get(parts.queue.set_learner_version.remote(version))
    return version
