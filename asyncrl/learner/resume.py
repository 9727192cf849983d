"""The driver's half of checkpoint and resume.

    save:   queue accounting + every actor's task-sampler state ─▶ learner.save(PATH, that)
    resume: learner.load(PATH) ─▶ version V, driver state ─▶ queue accounting and samplers
            restored ─▶ weights of V published to the actors ─▶ the loop continues at V

Queued trajectories are ObjectRefs of the old run and die with it: a resumed run counts
what was queued at the checkpoint as dropped, so ``produced == trained + dropped +
in_queue`` still holds (``ReplayBuffer.resume_from``); every actor's prompt stream
continues where it was (``RolloutActor.sampler_state`` / ``load_sampler_state``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncrl.config import ConfigError
from asyncrl.learner.layout import CheckpointError, find_latest, publish, step_dir, verify
from asyncrl.storage.sink import allow_reads_from


def check_resume(path: str) -> None:
    """A resumable checkpoint, or a run directory holding one (cheap: sizes against the
    manifest; CRCs on load)."""
    try:
        verify(find_latest(path), full=False)
    except (CheckpointError, OSError, ValueError) as e:
        raise ConfigError(f"resume={path}: {e}") from e


def driver_state(parts: Any) -> dict[str, Any]:
    import ray

    names = list(parts.actors)
    samplers = ray.get([parts.actors[n].sampler_state.remote() for n in names])
    return {
        "queue": ray.get(parts.queue.state_dict.remote()),
        "samplers": dict(zip(names, samplers)),
    }


def save_checkpoint(parts: Any, run_dir: Path, version: int, keep: int) -> str:
    """Learner state (sharded) plus the driver's state in ``RUN/checkpoints/step-V``, then
    ``RUN/checkpoint`` points at it and only the newest ``keep`` steps stay (0: all)."""
    out = parts.learner.save(str(step_dir(run_dir, version)), driver_state(parts))
    publish(run_dir, version, keep)
    return out


def resume(parts: Any, path: str) -> int:
    """Continue from ``path`` (a checkpoint, or a run directory: its newest complete
    checkpoint); returns the policy version the run continues from."""
    return resume_state(parts, path)[0]


def resume_state(parts: Any, path: str) -> tuple[int, dict[str, Any]]:
    """:func:`resume`, also returning the checkpoint's driver state (its queue accounting:
    what a learner restart adds the dead segment's production to, asyncrl/fault/learner.py)."""
    import ray

    found = find_latest(Path(path).absolute())  # absolute: a rank on another node reads it
    allow_reads_from(found)  # a cluster's ranks on other nodes fetch it through the sink
    meta = parts.learner.load(str(found))
    version = int(meta["version"])
    ds = meta.get("driver_state") or {}
    if "queue" in ds:
        ray.get(parts.queue.resume_from.remote(ds["queue"]))
    for name, state in ds.get("samplers", {}).items():
        if name in parts.actors:
            ray.get(parts.actors[name].load_sampler_state.remote(state))
    parts.broker.publish(version)  # the broker takes the loaded weights from the learner
    parts.broker.wait()
    ray.get(parts.queue.set_learner_version.remote(version))
    return version, ds
