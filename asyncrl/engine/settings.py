"""An engine's settings and its requests' sampling (``actor.engine``, ``actor.sampling``
in config; the judge's and eval's engines take the same keys). Pure Python: cheap to
import anywhere; conf/actor/default.yaml holds every value."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from asyncrl.config import ConfigError, Settings, check_finite, setting

# The name asyncrl's transport is registered under in vLLM's WeightTransferEngineFactory
# (asyncrl/engine/vllm_transfer.py): an engine with weight_transfer_config={"backend":
# TRANSFER_BACKEND} takes weights through vLLM's own update API (broker.engine_api=vllm)
TRANSFER_BACKEND = "asyncrl"

# vLLM's ``dtype`` names (EngineArgs.dtype)
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


class EngineBackend(enum.StrEnum):
    """Which library an engine runs on (asyncrl/engine/backend.py picks the class)."""

    VLLM = "vllm"  # vllm_engine.VLLMEngine: vLLM's AsyncLLM with asyncrl's worker extension
    SGLANG = "sglang"  # sglang_engine.SGLangEngine: SGLang's offline Engine (docs/engines.md)


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
    """``actor.engine``: the engine. Names follow vLLM's EngineArgs; with
    ``backend=sglang`` the keys SGLang has an equivalent for map onto its ServerArgs
    (``sglang_engine.server_kwargs``) and the vLLM-only ones are unused."""

    KEY = "actor.engine"

    backend: EngineBackend = setting()

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
    # vLLM worker processes splitting the model (vLLM's tensor parallelism; on a CPU
    # each worker binds its OpenMP threads to its own cores: engine/cpu_binding.py)
    tensor_parallel_size: int = setting("[1, 64]")
    # a CPU engine with one worker runs it in the engine-core process (engine/in_core.py)
    in_core_worker: bool = setting()
    # that engine-core process forked from a server that imported vLLM while the caller
    # started (engine/launcher.py), not spawned fresh
    forkserver: bool = setting()
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
        if "tensor_parallel_size" in self.extra:  # one source: the key of its own
            raise ConfigError(
                f"{key}extra.tensor_parallel_size: set {key}tensor_parallel_size instead"
            )
