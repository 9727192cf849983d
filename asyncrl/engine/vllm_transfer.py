"""asyncrl's transport as a vLLM weight-transfer backend (``broker.engine_api=vllm``).

vLLM's own weight-update API drives it: the actor calls AsyncLLM's
``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update(weight_version)``, each a ``collective_rpc`` to the workers'
methods of those names, which call this engine (vllm/v1/worker/gpu_worker.py; the CPU
worker inherits them). The plugin (asyncrl/engine/vllm_plugin.py) registers it under
``TRANSFER_BACKEND`` (asyncrl/engine/settings.py); an engine started with
``weight_transfer_config={"backend": TRANSFER_BACKEND}`` builds one per worker once its
model is loaded.

    init_weight_transfer_engine(JoinSpec) ─▶ join group `key` (first use; else nothing)
    start_weight_update                   ─▶ nothing (the reload below is whole)
    update_weights({key, with_digests})   ─▶ receive into the held copy, reload in place,
                                             re-tie the head (the worker extension's code)
    finish_weight_update                  ─▶ nothing; vLLM then sets the weight version

None of vLLM's calls returns a value, so the worker's report (bytes, seconds, held
version, the error with its bucket and peers) stays on the receiver endpoint and the
actor reads it with one more call (``asyncrl_last_report``). The endpoint is the
worker's one: the worker extension's own calls (weight state, digests, closing groups)
see the groups joined here.

Why vLLM's registered backends are not used on a CPU: each needs CUDA (NCCL, CUDA IPC,
Ray direct transport of CUDA tensors), and the base class's ``update_weights`` ends in
``torch.accelerator.synchronize()``, which raises "Cannot access accelerator device
when none is available" on a CPU-only torch; this engine overrides it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferUpdateInfo

from asyncrl.engine.worker_ext import AsyncRLWorkerExtension
from asyncrl.transport.endpoint import ReceiverEndpoint
from asyncrl.transport.group import TransferError
from asyncrl.transport.spec import JoinSpec


@dataclasses.dataclass
class UpdateInfo(WeightTransferUpdateInfo):
    """One ``update_weights`` call: the next sync of group ``key`` (joined by the init
    call); ``with_digests``: keep per-tensor digests of what was loaded."""

    key: str
    with_digests: bool = False


class ModelView:
    """The model runner as the worker extension's loading reads it (``get_model``,
    ``model_config``, ``reload_weights``), from what vLLM gives a transfer engine. The
    reload is vLLM's in-place one, as the runner's; the runner's cache resets after it
    are the worker's ``finish_weight_update`` (LoRA state) and the actor's (a
    multi-modal engine's encoder cache)."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any):
        self.model = model
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config

    def get_model(self) -> torch.nn.Module:
        return self.model

    def reload_weights(self, weights_iterator: Any) -> None:
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        reload_weights(
            self.vllm_config, self.model, weights_iterator=weights_iterator,
            weights_path=None, is_checkpoint_format=True,
        )  # fmt: skip


class GlooTransferEngine(WeightTransferEngine):
    """One vLLM worker's end of asyncrl's transport behind vLLM's weight-transfer API
    (gloo on a CPU, NCCL where both ends have CUDA: ``JoinSpec.backend``)."""

    init_info_cls = JoinSpec
    update_info_cls = UpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: Any):
        super().__init__(config, vllm_config, device, model)
        # the worker extension's receive and load, on this engine's model
        self.asyncrl_worker = AsyncRLWorkerExtension()
        self.asyncrl_worker.model_runner = ModelView(model, vllm_config)
        dist = torch.distributed
        self.asyncrl_worker.rank = dist.get_rank() if dist.is_initialized() else 0
        self.specs: dict[str, dict[str, Any]] = {}  # group key -> its JoinSpec on the wire

    def endpoint(self) -> ReceiverEndpoint:
        return self.asyncrl_worker.asyncrl_endpoint()

    def parse_init_info(self, init_dict: dict[str, Any]) -> JoinSpec:
        return JoinSpec.from_wire(init_dict)

    def init_transfer_engine(self, init_info: JoinSpec) -> None:
        """Join group ``init_info.key`` as this worker's rank in it (the engine's first
        rank plus the worker's own); nothing when joined already."""
        rx = self.endpoint()
        rx.last_report = None
        spec = dataclasses.replace(init_info, rank=init_info.rank + self.asyncrl_worker.rank)
        rx.join(spec)
        self.specs[init_info.key] = dataclasses.asdict(init_info)

    def start_weight_update(self) -> None:
        """Nothing: the whole model is received into the held copy and reloaded in one
        ``update_weights`` (a partial layerwise reload could mix fresh and stale shards
        of fused parameters)."""

    def finish_weight_update(self) -> None:
        """Nothing: ``update_weights`` loaded everything."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's own ends in torch.accelerator.synchronize(), which a CPU has not; this
        # load is synchronous on either device (the reload's copies are)
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: UpdateInfo) -> None:
        """Receive group ``key``'s next sync and reload it in place; a failure raises
        (vLLM then ends the update session) and its report stays on the endpoint."""
        spec = self.specs.get(update_info.key)
        if spec is None or not self.endpoint().joined(update_info.key):
            raise TransferError(
                f"group {update_info.key!r} not joined: init_weight_transfer_engine first"
            )
        report = self.asyncrl_worker.asyncrl_sync(spec, update_info.with_digests)
        if not report["ok"]:
            raise TransferError(report["error"])

    def shutdown(self) -> None:
        self.endpoint().close_all()
