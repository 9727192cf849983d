"""``learner`` config: start-up checks and the keyword arguments of the ranks.

Everything here runs in the driver before any rank starts, so a mistake stops the run
with the key to change.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from asyncrl.config import ConfigError

RANK_KEYS = (
    "micro_batch_tokens", "normalisation", "num_threads", "pack_row_tokens", "value_head",
    "collective_timeout_s", "attn_implementation", "minibatches",
)  # fmt: skip


def optim_settings(lc: DictConfig, max_steps: int):
    from asyncrl.learner.optim import OptimSettings

    spec = OmegaConf.to_container(lc.optim, resolve=True)
    if spec.get("total_steps") is None:  # the schedule counts optimizer steps
        spec["total_steps"] = max_steps * max(int(lc.get("minibatches", 1)), 1)
    try:
        return OptimSettings(**spec)
    except TypeError as e:
        raise ConfigError(f"learner.optim: {e}") from e
    except ValueError as e:
        raise ConfigError(str(e)) from e


def check_learner_config(lc: DictConfig, loss: Any, max_steps: int) -> None:
    from asyncrl.learner.learner import NORMALISATIONS, check_value_head

    for key in ("world_size", "micro_batch_tokens", "minibatches"):
        if lc[key] < 1:
            raise ConfigError(f"learner.{key} must be >= 1, got {lc[key]}")
    if lc.num_cpus <= 0:
        raise ConfigError(f"learner.num_cpus must be > 0 (Ray CPUs per rank), got {lc.num_cpus}")
    if lc.normalisation not in NORMALISATIONS:
        raise ConfigError(
            f"learner.normalisation must be one of {NORMALISATIONS}, got {lc.normalisation!r}"
        )
    if lc.pack_row_tokens is not None and lc.pack_row_tokens < 1:
        raise ConfigError(f"learner.pack_row_tokens must be >= 1 or null, got {lc.pack_row_tokens}")
    try:
        check_value_head(loss, bool(lc.value_head))
    except ValueError as e:
        raise ConfigError(str(e)) from e
    optim_settings(lc, max_steps)


def check_resume(path: str) -> None:
    """A resumable checkpoint (cheap: sizes against the manifest; CRCs on load)."""
    from asyncrl.learner.checkpoint import CheckpointError, verify

    try:
        verify(path, full=False)
    except (CheckpointError, OSError, ValueError) as e:
        raise ConfigError(f"resume={path}: {e}") from e


def start_learner(
    lc: DictConfig, model_path: str, loss: Any, advantage: Any, sampling: Any, seed: int,
    max_steps: int, trajectory_log: str | None,
):  # fmt: skip
    """The :class:`LearnerGroup` of ``learner`` config (ranks start in the background)."""
    from asyncrl.learner.group import LearnerGroup

    kw = {k: lc[k] for k in RANK_KEYS}
    return LearnerGroup(
        model_path, loss, advantage, optim_settings(lc, max_steps),
        world_size=lc.world_size, num_cpus=lc.num_cpus, num_gpus=lc.num_gpus,
        trajectory_log=trajectory_log, temperature=sampling.temperature, top_k=sampling.top_k,
        top_p=sampling.top_p, seed=seed, **kw,
    )  # fmt: skip
