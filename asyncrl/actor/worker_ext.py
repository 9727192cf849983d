"""vLLM worker extension: runs inside each vLLM worker process.

vLLM mixes this class into its Worker (``worker_extension_cls``), so ``self`` is the
worker and ``self.model_runner`` its model runner. Tensors cannot travel as
``collective_rpc`` arguments (they arrive mangled), so weights come by another road:
a safetensors file (the object-store transport) or a side process group (the broker).
"""

from __future__ import annotations

import hashlib

import torch


class AsyncRLWorkerExtension:
    def asyncrl_load_file(self, path: str) -> int:
        """Reload every weight in place from a safetensors file; returns tensors loaded."""
        from safetensors.torch import load_file

        state = load_file(path)
        self.model_runner.reload_weights(weights_iterator=iter(state.items()))
        self._asyncrl_retie()
        return len(state)

    def _asyncrl_retie(self) -> None:
        """vLLM's in-place reload puts the *old* tensor back on a layer it loaded
        nothing for; a tied LM head (weight shared with the embedding, never in the
        checkpoint) is such a layer, so it would keep the previous version's weights.
        Tie it to the freshly loaded embedding again, and redo the head's
        after-loading step: on the CPU that step prepacks the GEMM weight, and a
        stale prepacked copy would keep producing the old logits."""
        model = self.model_runner.get_model()
        hf = self.model_runner.model_config.hf_config
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if getattr(hf, "tie_word_embeddings", False) and head is not None and embed is not None:
            head.weight = embed.weight
            method = getattr(head, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(head)

    def asyncrl_checksums(self) -> dict[str, str]:
        """Per-parameter sha256 of the raw bytes held by the engine (bit-exactness checks)."""
        out = {}
        for name, p in self.model_runner.get_model().named_parameters():
            t = p.detach().contiguous().cpu()
            out[name] = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
        return out
