"""The actor's settings (``actor.*`` in config), typed and checked once, in the driver
before Ray starts: :meth:`ActorSettings.from_config` names the key of any value it
refuses (``actor.<key>``, ``actor.sampling.<key>``, ``actor.engine.<key>``).

Pure Python (no torch, no vLLM, no Ray): cheap to import anywhere.

Defaults: conf/actor/default.yaml holds every value (``ActorSettings.defaults()``
builds them as ``asyncrl-train`` does); the fields here have none.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from asyncrl.config import ConfigError, Settings, check_finite, setting
from asyncrl.utils.affinity import parse_cpu_list

# vLLM's ``dtype`` names (EngineArgs.dtype)
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


class UpdateMode(enum.StrEnum):
    """What a weight update does to the requests in flight (actor/weights.py)."""

    ABORT = "abort"  # drop them (their groups are generated again) and clear the KV cache
    WAIT = "wait"  # let them finish on the old weights first, then clear the KV cache
    KEEP = "keep"  # freeze them with their KV and continue them on the new weights


@dataclass
class SamplingSettings(Settings):
    """``actor.sampling``; the learner applies the same temperature/top-k/top-p."""

    KEY = "actor.sampling"

    n: int = setting(">= 1")  # samples per prompt (one group)
    # > 0: greedy sampling has no log-probs for the learner to correct with
    temperature: float = setting("> 0")
    top_p: float = setting("(0, 1]")
    top_k: int = setting(">= -1")  # 0 (or -1): off
    max_tokens: int = setting(">= 1")


@dataclass
class EngineSettings(Settings):
    """``actor.engine``: the vLLM engine. Names follow vLLM's EngineArgs."""

    KEY = "actor.engine"

    dtype: str = setting()  # float32 on both sides: actor and learner log-probs agree to ~0
    max_model_len: int = setting(">= 1")
    max_num_seqs: int = setting(">= 1")
    kv_cache_memory_mb: int = setting(">= 1")  # CPU: an explicit KV budget, not a RAM share
    enforce_eager: bool = setting()
    enable_prefix_caching: bool = setting()  # never reuse KV across policy versions by accident
    # vLLM's per-iteration stats and Prometheus metrics: ~12% of the actor process's CPU
    # on this task's short answers, and nothing here reads them
    disable_log_stats: bool = setting()
    gpu_memory_utilization: float = setting("(0, 1]")
    # vLLM's message-queue readers spin on sched_yield between model steps; on a CPU that
    # takes the learner's core (asyncrl/engine/vllm_plugin.py). Seconds each turn of that
    # wait sleeps instead; null: 0.0002 on a CPU, vLLM's spin on a GPU; 0: vLLM's spin.
    spin_nap_s: float | None = setting("[0, 0.01]")
    extra: dict[str, Any] = setting()  # any other EngineArgs field

    def __post_init__(self) -> None:
        super().__post_init__()
        key = "actor.engine."
        if self.dtype not in DTYPES:
            raise ConfigError(f"{key}dtype={self.dtype!r}: expected one of {', '.join(DTYPES)}")
        if self.extra is None:
            self.extra = {}
        if not isinstance(self.extra, Mapping) or not all(isinstance(k, str) for k in self.extra):
            raise ConfigError(
                f"{key}extra={self.extra!r}: expected a mapping of vLLM EngineArgs names to values"
            )
        self.extra = dict(self.extra)
        check_finite(key + "extra", self.extra)


@dataclass
class ActorSettings(Settings):
    """``actor``: how many rollout actors, and how each one generates."""

    KEY = "actor"

    num_actors: int = setting(">= 1")
    num_cpus: float = setting(">= 0")  # Ray CPUs reserved per actor
    num_gpus: float = setting(">= 0")  # Ray GPUs per actor (1 on a GPU cluster: its engine's own)
    max_inflight_groups: int = setting(">= 1")  # prompts generating at once in one engine
    handoff_linger_ms: float = setting("[0, 60000]")  # finished groups wait this long to travel
    # CPU list ("0", "0-3", "0,2", or a YAML list of CPUs) of the engine; None: the OS's
    engine_cores: str | int | list | None = setting()
    update_mode: UpdateMode = setting()
    sampling: SamplingSettings = setting()
    engine: EngineSettings = setting()

    def __post_init__(self) -> None:
        super().__post_init__()
        self.engine_cores = _cpu_list("actor.engine_cores", self.engine_cores)
        try:
            self.update_mode = UpdateMode(self.update_mode)
        except ValueError:
            raise ConfigError(
                f"actor.update_mode={self.update_mode!r}: expected one of "
                f"{', '.join(m.value for m in UpdateMode)}"
            ) from None

    @property
    def handoff_linger_s(self) -> float:
        return self.handoff_linger_ms / 1000


def _cpu_list(key: str, value: Any) -> str | None:
    """A CPU list as one string ("0", "0-3", "0,2"), from a string, an integer or a
    (YAML) list of them; None stays None."""
    if value is None:
        return None
    try:
        if isinstance(value, bool | float):
            raise ValueError("not a CPU list")
        spec = value if isinstance(value, str | int) else ",".join(str(x) for x in value)
        parse_cpu_list(spec)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value!r}: not a CPU list (e.g. '0', '0-3', '0,2')") from None
    return str(spec)
