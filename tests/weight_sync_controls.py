"""Test-side controls of the weight sync (never shipped in ``asyncrl``).

- :class:`FaultyWorkerExtension`: asyncrl's vLLM worker extension plus
  ``asyncrl_inject_fault``, which makes the worker ``kill`` itself (SIGKILL, like an
  OOM kill) or ``stall`` (a stuck peer) at a payload bucket of its next sync. Select it
  for a real engine with ``EngineSettings.defaults(extra={"worker_extension_cls":
  FAULTY_EXTENSION})``; ``ControlledRolloutActor.inject_weight_fault`` then reaches it
  through ``collective_rpc("asyncrl_inject_fault", ...)``.
- :class:`TransferProbeExtension` (``TRANSFER_PROBE``): the extension plus
  ``asyncrl_transfer_groups``, the groups vLLM's weight-transfer engine joined.
- :func:`set_policy`: change a running WeightBroker's payload mode / rolling width.
- :func:`learner_digests`: per-tensor digests of the learner's live weights.

Import it as ``tests.weight_sync_controls`` (the name the engine's workers and Ray's
processes resolve; the repository root is on their path).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from asyncrl.engine.worker_ext import AsyncRLWorkerExtension
from asyncrl.transport.endpoint import ReceiverEndpoint

FAULTY_EXTENSION = "tests.weight_sync_controls.FaultyWorkerExtension"
FAULT_KINDS = ("kill", "stall")


def arm_fault(rx: ReceiverEndpoint, kind: str, bucket: int, seconds: float = 0.0) -> None:
    """At payload ``bucket`` of ``rx``'s next sync: ``kill`` this process or ``stall``
    for ``seconds``. Through the endpoint's progress hook, once."""
    if kind not in FAULT_KINDS:
        raise ValueError(f"fault kind must be kill or stall, got {kind!r}")

    def hook(i: int) -> None:
        if i != bucket:
            return
        rx.on_bucket = None
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(seconds)

    rx.on_bucket = hook


class FaultyWorkerExtension(AsyncRLWorkerExtension):
    def asyncrl_inject_fault(self, kind: str, bucket: int, seconds: float = 0.0) -> int:
        """Arm a fault for the next sync; returns the worker's pid."""
        arm_fault(self._asyncrl_rx(), kind, bucket, seconds)
        return os.getpid()

    def asyncrl_sync(self, spec: dict[str, Any], with_digests: bool = False) -> dict[str, Any]:
        try:
            return super().asyncrl_sync(spec, with_digests)
        finally:
            self._asyncrl_rx().on_bucket = None  # a fault lasts one sync, reached or not


TRANSFER_PROBE = "tests.weight_sync_controls.TransferProbeExtension"


class TransferProbeExtension(AsyncRLWorkerExtension):
    def asyncrl_transfer_groups(self) -> list[str] | None:
        """The groups vLLM's weight-transfer engine was initialised for (None: vLLM made
        none): evidence a sync went through vLLM's API, not ``asyncrl_sync``."""
        engine = getattr(self, "weight_transfer_engine", None)
        return None if engine is None else sorted(engine.specs)


def _set_policy(broker: Any, mode: str, rolling_k: int) -> None:
    broker.s.mode, broker.s.rolling_k = mode, rolling_k
    broker.s.check()


def set_policy(client: Any, mode: str, rolling_k: int = 0) -> None:
    """The payload mode and rolling width of a running WeightBroker's later syncs
    (``client``: a BrokerClient)."""
    import ray

    ray.get(client.handle.__ray_call__.remote(_set_policy, mode, rolling_k))


def _set_reshard(broker: Any, on: bool) -> None:
    broker.s.reshard = on


def set_reshard(client: Any, on: bool) -> None:
    """Whether a running WeightBroker's later syncs send each TP worker only its shard."""
    import ray

    ray.get(client.handle.__ray_call__.remote(_set_reshard, on))


def learner_digests(ranks: list[Any]) -> dict[str, str]:
    """Per-tensor digests of the live weights (every rank takes part; rank 0's answer)."""
    import ray

    return ray.get([r.weight_digests.remote() for r in ranks], timeout=120)[0]
