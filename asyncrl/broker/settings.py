"""``broker.*`` in config: which broker, and how the process-group broker syncs.

Checked at start-up (``BrokerSettings.from_config``), before Ray starts, so a wrong
value stops the run with one line naming the ``broker.<key>``. conf/broker/gloo.yaml
lists the same values as the defaults here (tests/test_broker.py holds them equal).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from asyncrl.config import ConfigError, settings_from

BACKENDS = ("auto", "gloo", "nccl")
# transport.delta.Mode's values, spelled out so that checking a config needs no torch
PAYLOAD_MODES = ("full", "changed_buckets", "sparse_delta")


class BrokerKind(enum.StrEnum):
    OBJECTSTORE = "objectstore"  # the learner ray.put()s its weights, actors reload them
    GLOO = "gloo"  # process group: gloo on CPU, NCCL where both ends have CUDA


@dataclass
class BrokerSettings:
    kind: BrokerKind = BrokerKind.GLOO
    backend: str = "auto"  # auto: NCCL when the learner has CUDA, else gloo
    mode: str = "sparse_delta"  # full | changed_buckets | sparse_delta (all lossless)
    rolling_k: int = 0  # > 0: at most k actors update at once, the rest keep generating
    bucket_mb: float = 64.0  # flat bucket size per dtype
    timeout_s: float = 60.0  # per collective / store wait (objectstore: per sync)
    join_timeout_s: float = 120.0  # forming a group (workers answer between engine steps)
    pause_timeout_s: float = 300.0  # `wait` mode: in-flight requests must finish within this
    hold_copy: bool = True  # workers keep a copy for deltas (one model of memory per worker)
    shadow_device: str | None = None  # learner-side versions for deltas; null = transfer device
    max_versions: int = 4  # learner-side versions kept for actors that fell behind
    max_failures: int = 3  # consecutive failed syncs before a live actor is dropped
    max_groups: int = 8  # cached process groups (one per recurring sync set)
    retry: bool = True  # retry live members of a failed set once, in a fresh group
    prime: bool = True  # at start, sync version 0 (fails fast; later syncs are deltas)
    verify: bool = False  # per-tensor sha256 on both ends every sync (costly: tests, debugging)
    host: str | None = None  # learner address the workers connect to; null = its node IP

    @classmethod
    def from_config(cls, node: Any) -> BrokerSettings:
        """From a ``broker`` config node (or a dict); ConfigError names ``broker.<key>``."""
        return settings_from(cls, node, "broker")

    def check(self) -> None:
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
        if self.rolling_k < 0:
            bad("rolling_k", "must be >= 0 (0: every actor at once)")
        for key in ("bucket_mb", "timeout_s", "join_timeout_s", "pause_timeout_s"):
            if getattr(self, key) <= 0:
                bad(key, "must be > 0")
        for key in ("max_versions", "max_failures", "max_groups"):
            if getattr(self, key) < 1:
                bad(key, "must be >= 1")
        if self.shadow_device not in (None, "cpu", "cuda"):
            bad("shadow_device", "expected null, cpu or cuda")
        if not self.hold_copy and self.mode != "full":
            bad("mode", "partial modes need broker.hold_copy=true (the receiver's base)")
