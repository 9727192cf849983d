"""The actor's settings (``actor.*`` in config), typed and checked once, in the driver
before Ray starts: :meth:`ActorSettings.from_config` names the key of any value it
refuses (``actor.<key>``, ``actor.sampling.<key>``, ``actor.engine.<key>``).

Pure Python (no torch, no vLLM, no Ray): cheap to import anywhere.

Defaults: every default here equals ``conf/actor/default.yaml``'s value
(``tests/test_actor_settings.py`` holds them equal), so an object built in code and
one built from the shipped config are the same settings.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from asyncrl.config import ConfigError
from asyncrl.utils.affinity import parse_cpu_list

# vLLM's ``dtype`` names (EngineArgs.dtype)
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


class UpdateMode(enum.StrEnum):
    """What a weight update does to the requests in flight (actor/weights.py)."""

    ABORT = "abort"  # drop them (their groups are generated again) and clear the KV cache
    WAIT = "wait"  # let them finish on the old weights first, then clear the KV cache
    KEEP = "keep"  # freeze them with their KV and continue them on the new weights


@dataclass
class SamplingSettings:
    """``actor.sampling``; the learner applies the same temperature/top-k/top-p."""

    n: int = 8  # samples per prompt (one group)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): off
    max_tokens: int = 6

    def __post_init__(self) -> None:
        key = "actor.sampling."
        _check_int(key + "n", self.n, 1)
        _check_number(key + "temperature", self.temperature)
        if self.temperature <= 0:
            raise ConfigError(
                f"{key}temperature={self.temperature!r}: expected > 0 (greedy sampling has "
                "no log-probs for the learner to correct with)"
            )
        _check_number(key + "top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"{key}top_p={self.top_p!r}: expected a number in (0, 1]")
        _check_int(key + "top_k", self.top_k, -1)
        _check_int(key + "max_tokens", self.max_tokens, 1)


@dataclass
class EngineSettings:
    """``actor.engine``: the vLLM engine. Names follow vLLM's EngineArgs."""

    dtype: str = "float32"  # fp32 on both sides makes actor and learner log-probs agree to ~0
    max_model_len: int = 64
    max_num_seqs: int = 64
    kv_cache_memory_mb: int = 256  # CPU: an explicit KV budget, not a fraction of RAM
    enforce_eager: bool = True
    enable_prefix_caching: bool = False  # never reuse KV across policy versions by accident
    # vLLM's per-iteration stats and Prometheus metrics: ~12% of the actor process's CPU
    # on this task's short answers, and nothing here reads them
    disable_log_stats: bool = True
    gpu_memory_utilization: float = 0.5
    # vLLM's message-queue readers spin on sched_yield between model steps; on a CPU that
    # takes the learner's core (asyncrl/engine/vllm_plugin.py). Seconds each turn of that
    # wait sleeps instead; null: 0.0002 on a CPU, vLLM's spin on a GPU; 0: vLLM's spin.
    spin_nap_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # any other EngineArgs field

    def __post_init__(self) -> None:
        key = "actor.engine."
        if self.dtype not in DTYPES:
            raise ConfigError(f"{key}dtype={self.dtype!r}: expected one of {', '.join(DTYPES)}")
        for name in ("max_model_len", "max_num_seqs", "kv_cache_memory_mb"):
            _check_int(key + name, getattr(self, name), 1)
        for name in ("enforce_eager", "enable_prefix_caching", "disable_log_stats"):
            _check_bool(key + name, getattr(self, name))
        _check_number(key + "gpu_memory_utilization", self.gpu_memory_utilization)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"{key}gpu_memory_utilization={self.gpu_memory_utilization!r}: expected a "
                "number in (0, 1]"
            )
        if self.spin_nap_s is not None:
            _check_number(key + "spin_nap_s", self.spin_nap_s)
            if not 0 <= self.spin_nap_s <= 0.01:
                raise ConfigError(
                    f"{key}spin_nap_s={self.spin_nap_s!r}: expected null or seconds in "
                    "[0, 0.01] (0: vLLM's own spin)"
                )
        if self.extra is None:
            self.extra = {}
        if not isinstance(self.extra, Mapping) or not all(isinstance(k, str) for k in self.extra):
            raise ConfigError(
                f"{key}extra={self.extra!r}: expected a mapping of vLLM EngineArgs names to values"
            )
        self.extra = dict(self.extra)


@dataclass
class ActorSettings:
    """``actor``: how many rollout actors, and how each one generates."""

    num_actors: int = 1
    num_cpus: float = 1  # Ray CPUs reserved per actor
    num_gpus: float = 0  # Ray GPUs per actor (1 on a GPU cluster: its engine's own)
    max_inflight_groups: int = 256  # prompts generating at once in one engine
    handoff_linger_ms: float = 100  # finished groups wait up to this long to travel together
    engine_cores: str | None = None  # CPU list ("0", "0-3", "0,2") of the engine; None: the OS's
    update_mode: UpdateMode = UpdateMode.KEEP
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)

    def __post_init__(self) -> None:
        _check_int("actor.num_actors", self.num_actors, 1)
        _check_number("actor.num_cpus", self.num_cpus)
        if self.num_cpus < 0:
            raise ConfigError(f"actor.num_cpus={self.num_cpus!r}: expected a number >= 0")
        _check_number("actor.num_gpus", self.num_gpus)
        if self.num_gpus < 0:
            raise ConfigError(f"actor.num_gpus={self.num_gpus!r}: expected a number >= 0")
        _check_int("actor.max_inflight_groups", self.max_inflight_groups, 1)
        _check_number("actor.handoff_linger_ms", self.handoff_linger_ms)
        if self.handoff_linger_ms < 0:
            raise ConfigError(
                f"actor.handoff_linger_ms={self.handoff_linger_ms!r}: expected a number >= 0"
            )
        self.engine_cores = _cpu_list("actor.engine_cores", self.engine_cores)
        try:
            self.update_mode = UpdateMode(self.update_mode)
        except ValueError:
            raise ConfigError(
                f"actor.update_mode={self.update_mode!r}: expected one of "
                f"{', '.join(m.value for m in UpdateMode)}"
            ) from None
        for name, cls in (("sampling", SamplingSettings), ("engine", EngineSettings)):
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(
                    f"actor.{name}: expected {cls.__name__}, got {getattr(self, name)!r}"
                )

    @property
    def handoff_linger_s(self) -> float:
        return self.handoff_linger_ms / 1000

    @classmethod
    def from_config(cls, node: Any) -> ActorSettings:
        """From the ``actor`` config node (a DictConfig or a dict). Keys it leaves out
        keep their defaults; an unknown key or a bad value raises :class:`ConfigError`
        naming it."""
        top = _known("actor", cls, node)
        sampling = _known("actor.sampling", SamplingSettings, top.pop("sampling", None))
        engine = _known("actor.engine", EngineSettings, top.pop("engine", None))
        return cls(**top, sampling=SamplingSettings(**sampling), engine=EngineSettings(**engine))


def _plain(key: str, node: Any) -> dict[str, Any]:
    """``node`` (a DictConfig, a dict or None) as a plain dict, interpolations resolved."""
    from omegaconf import DictConfig, OmegaConf

    if node is None:
        return {}
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True)
    if isinstance(node, Mapping):
        return dict(node)
    raise ConfigError(f"{key}: expected a mapping of settings, got {node!r}")


def _known(key: str, cls: type, node: Any) -> dict[str, Any]:
    """``node``'s items, refusing any key ``cls`` has no field for."""
    items = _plain(key, node)
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(items) - set(names))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}: unknown key; {key} accepts {', '.join(names)}")
    return items


def _check_int(key: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{key}={value!r}: expected an integer >= {low}")


def _check_number(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key}={value!r}: expected a number")


def _check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: expected true or false")


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
