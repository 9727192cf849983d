"""``broker.*`` in config: which broker, and how the process-group broker syncs.

Checked at start-up (``check_broker_config``), before Ray starts, so a wrong
value stops the run with a message naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

BROKERS = ("objectstore", "gloo")  # gloo = "process group": NCCL where both ends have CUDA
BACKENDS = ("auto", "gloo", "nccl")
# transport.delta.Mode's values, spelled out so that checking a config needs no torch
PAYLOAD_MODES = ("full", "changed_buckets", "sparse_delta")


@dataclass
class BrokerSettings:
    kind: str = "gloo"
    backend: str = "auto"  # auto: NCCL when the learner has CUDA, else gloo
    mode: str = "sparse_delta"  # full | changed_buckets | sparse_delta (all lossless)
    rolling_k: int = 0  # > 0: at most k actors update at once, the rest keep generating
    bucket_mb: float = 64.0  # flat bucket size per dtype
    timeout_s: float = 60.0  # per collective / store wait: a stuck peer is named after this
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
        """From a ``broker`` config node; ValueError names the ``broker.<key>`` to fix."""
        from omegaconf import DictConfig, OmegaConf

        raw = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
        raw = dict(raw or {})
        raw.pop("_target_", None)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"broker: unknown key(s) {unknown}; known: {sorted(known)}")
        s = cls(**raw)
        s.check()
        return s

    def check(self) -> None:
        def bad(key: str, why: str) -> None:
            raise ValueError(f"broker.{key}={getattr(self, key)!r}: {why}")

        if self.kind not in BROKERS:
            bad("kind", f"expected one of {BROKERS}")
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


def check_broker_config(node: Any) -> BrokerSettings | None:
    """Validate ``broker.*``; the process-group settings, or None for the object store.
    Raises asyncrl.config.ConfigError naming the key."""
    from asyncrl.config import ConfigError

    kind = node.get("kind") if hasattr(node, "get") else None
    if kind not in BROKERS:
        raise ConfigError(f"broker.kind={kind!r}: expected one of {BROKERS}")
    if kind == "objectstore":
        return None
    try:
        return BrokerSettings.from_config(node)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from e
