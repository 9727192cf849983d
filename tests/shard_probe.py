"""Test-side probe of what each vLLM-CPU worker holds (never shipped in ``asyncrl``).

:class:`ShardProbeExtension` is asyncrl's worker extension plus ``asyncrl_params``:
every parameter the worker holds, as raw bytes, with its tensor-parallel rank (what
a TP engine's worker keeps of each learner tensor, compared bit for bit). vLLM-CPU
packs each linear layer's weight for its GEMM after loading and drops the plain one
(``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``); importing this module
(the worker does, to resolve the extension) makes that step keep a copy of the
weight as loaded first.

Select it with ``EngineSettings.defaults(extra={"worker_extension_cls":
SHARD_EXTENSION})``; ``ControlledRolloutActor.worker_params`` reaches it.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.engine.worker_ext import AsyncRLWorkerExtension

SHARD_EXTENSION = "tests.shard_probe.ShardProbeExtension"
LOADED = "asyncrl_loaded_weight"  # the layer attribute holding the copy


def keep_loaded_weights() -> None:
    """vLLM-CPU's GEMM dispatch keeps ``layer.<LOADED>``, the weight as loaded (once per
    process)."""
    from vllm.model_executor.layers import utils

    own = utils.dispatch_cpu_unquantized_gemm
    if getattr(own, "keeps_loaded", False):
        return

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        if not layer.weight.is_meta:
            setattr(layer, LOADED, layer.weight.detach().clone())
        own(layer, remove_weight)

    dispatch.keeps_loaded = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = dispatch


keep_loaded_weights()


def raw(t: torch.Tensor) -> tuple[str, list[int], bytes]:
    t = t.detach().contiguous().cpu()
    return str(t.dtype).removeprefix("torch."), list(t.shape), t.view(torch.uint8).numpy().tobytes()


class ShardProbeExtension(AsyncRLWorkerExtension):
    def asyncrl_params(self) -> dict[str, Any]:
        """``{"rank": tp rank, "params": {name: (dtype, shape, raw bytes)}}`` of every
        parameter this worker holds (its shard of a split layer; a packed linear
        layer's weight as it was loaded)."""
        model = self.model_runner.get_model()
        out = {name: raw(p) for name, p in model.named_parameters() if p.numel()}
        for name, module in model.named_modules():
            if hasattr(module, LOADED):
                out[f"{name}.weight"] = raw(getattr(module, LOADED))
        return {"rank": int(getattr(self, "rank", 0)), "params": out}
