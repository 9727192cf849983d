"""``broker.*`` in config: which broker, and how the process-group broker syncs.

Checked at start-up (``BrokerSettings.from_config``), before Ray starts, so a wrong
value stops the run with one line naming the ``broker.<key>``. conf/broker/gloo.yaml
holds every value (``BrokerSettings.defaults()``); objectstore.yaml and rolling.yaml
change a few of them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from asyncrl.config import TIMEOUT_S, ConfigError, Settings, setting

BACKENDS = ("auto", "gloo", "nccl")
# transport.delta.Mode's values, spelled out so that checking a config needs no torch
PAYLOAD_MODES = ("full", "changed_buckets", "sparse_delta")
# how an actor hands a sync to its engine's workers: asyncrl's worker extension
# (asyncrl_sync), or vLLM's weight-update API over asyncrl's transfer backend
ENGINE_APIS = ("asyncrl", "vllm")
# transport.shm.MODES, spelled out so that checking a config needs no torch: shared
# memory for receivers on the learner's host (auto) or the group's wire only (off)
SHM_MODES = ("auto", "off")


class BrokerKind(enum.StrEnum):
    OBJECTSTORE = "objectstore"  # the learner ray.put()s its weights, actors reload them
    GLOO = "gloo"  # process group: gloo on CPU, NCCL where both ends have CUDA


@dataclass
class BrokerSettings(Settings):
    KEY = "broker"

    kind: BrokerKind = setting()
    backend: str = setting()  # auto: NCCL when the learner has CUDA, else gloo
    mode: str = setting()  # full | changed_buckets | sparse_delta (all lossless)
    engine_api: str = setting()  # asyncrl | vllm (vLLM's update API; mode=full only)
    rolling_k: int = setting(">= 0")  # > 0: at most k actors update at once, the rest generate
    bucket_mb: float = setting("(0, 65536]")  # flat bucket size per dtype
    timeout_s: float = setting(TIMEOUT_S)  # per collective / store wait (objectstore: per sync)
    join_timeout_s: float = setting(TIMEOUT_S)  # forming a group (workers join between steps)
    pause_timeout_s: float = setting(TIMEOUT_S)  # `wait` mode: in-flight requests finish within
    hold_copy: bool = setting()  # workers keep a copy for deltas (one model of memory per worker)
    shadow_device: str | None = setting()  # learner-side versions for deltas; null = transfer's
    max_versions: int = setting(">= 1")  # learner-side versions kept for actors that fell behind
    max_failures: int = setting(">= 1")  # consecutive failed syncs before a live actor is dropped
    max_groups: int = setting(">= 1")  # cached process groups (one per recurring sync set)
    retry: bool = setting()  # retry live members of a failed set once, in a fresh group
    prime: bool = setting()  # at start, sync version 0 (fails fast; later syncs are deltas)
    verify: bool = setting()  # per-tensor sha256 on both ends every sync (tests, debugging)
    reshard: bool = setting()  # a tensor-parallel engine's workers each get only their shard
    shm: str = setting()  # auto: same-host receivers read the buckets from /dev/shm | off
    host: str | None = setting()  # learner address the workers connect to; null = its node IP

    def check(self) -> None:
        super().check()

        def bad(key: str, why: str) -> None:
            raise ConfigError(f"broker.{key}={getattr(self, key)!r}: {why}")

        try:
            self.kind = BrokerKind(self.kind)
        except ValueError:
            bad("kind", f"expected one of {[k.value for k in BrokerKind]}")
        if self.backend not in BACKENDS:
            bad("backend", f"expected one of {BACKENDS}")
        if self.mode not in PAYLOAD_MODES:
            bad("mode", f"expected one of {PAYLOAD_MODES} (rolling is broker.rolling_k > 0)")
        if self.shadow_device not in (None, "cpu", "cuda"):
            bad("shadow_device", "expected null, cpu or cuda")
        if not self.hold_copy and self.mode != "full":
            bad("mode", "partial modes need broker.hold_copy=true (the receiver's base)")
        if self.shm not in SHM_MODES:
            bad("shm", f"expected one of {SHM_MODES}")
        if self.engine_api not in ENGINE_APIS:
            bad("engine_api", f"expected one of {ENGINE_APIS}")
        if self.kind == BrokerKind.GLOO and self.engine_api == "vllm" and self.mode != "full":
            bad(
                "engine_api",
                f"vLLM's weight-update API takes whole models; broker.mode={self.mode} stays "
                "on asyncrl's (set broker.engine_api=asyncrl or broker.mode=full)",
            )
