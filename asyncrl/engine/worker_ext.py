"""vLLM worker extension: runs inside each vLLM worker process.

vLLM mixes this class into its Worker (``worker_extension_cls``), so ``self`` is the
worker and ``self.model_runner`` its model runner. Tensors cannot travel as
``collective_rpc`` arguments (they arrive mangled), so weights come by another road:
a safetensors file (the object-store transport) or a side process group (the broker).

Process-group sync, as the actor drives it: one ``collective_rpc`` per sync,
``asyncrl_sync(spec)``, sent after the actor paused generation (per its update mode):
join the group on first use, receive into the held copy, reload in place, re-tie
the LM head, report (:class:`~asyncrl.transport.endpoint.ReceiveReport` as a dict).
Every wait inside is bounded by the spec's timeouts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from asyncrl.engine import adapter, moe_reload, vllm_plugin
from asyncrl.engine.experts import ExpertRecorder
from asyncrl.transport.endpoint import ReceiverEndpoint
from asyncrl.transport.spec import JoinSpec

# vLLM loads the plugin through its entry point; asyncrl run from a checkout that pip
# never installed has none, so the worker applies it here too (once per process)
vllm_plugin.register()
moe_reload.install()  # a MoE model's reload packs its experts as the start did

LAYERWISE_LOG = "vllm.model_executor.model_loader.reload.layerwise"


class LayerwiseNotice(logging.Filter):
    """Drops vLLM's warnings about the reload of a layer, kept errors: it warns "Failed
    to load weights" on every reload for layers that have none in the checkpoint (the
    rotary embedding, which has no weights, and a tied LM head, which _asyncrl_retie
    fixes). A filter and not a level: the engine core runs vLLM's logging set-up
    (``configure_logging``, a ``dictConfig``) after this module is imported, which sets
    the level of every logger under ``vllm`` back to NOTSET and leaves filters be."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


logging.getLogger(LAYERWISE_LOG).addFilter(LayerwiseNotice())


class NarrowingNotice(logging.Filter):
    """Drops vLLM's "Attempted to load weight X with dtype float32 into parameter with
    dtype bfloat16": an engine at a narrower ``actor.engine.dtype`` than the learner's
    weights gets it for every such tensor at every update. vLLM casts each tensor to its parameter's own dtype, which is the intent; the
    tensors are left for vLLM to cast, because a parameter it keeps wider than the
    engine's dtype must get the full value."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Attempted to load weight %s with dtype")


logging.getLogger("vllm.model_executor.models.utils").addFilter(NarrowingNotice())

INPLACE_LOG = "vllm.model_executor.model_loader.reload.inplace"


class PartialReloadNotice(logging.Filter):
    """Drops vLLM's "Following weights were not loaded from checkpoint": a LoRA merge
    reloads only the adapted layers (the others keep their tensors), so every update
    would list all the rest. Applied only around such a reload: after a full sync the
    same line would mean a missing weight."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Following weights were not loaded")


@contextlib.contextmanager
def quiet(logger: str, notice: logging.Filter) -> Iterator[None]:
    log = logging.getLogger(logger)
    log.addFilter(notice)
    try:
        yield
    finally:
        log.removeFilter(notice)


class AsyncRLWorkerExtension:
    def asyncrl_load_file(self, path: str) -> int:
        """Reload every weight in place from a safetensors file; returns tensors loaded."""
        from safetensors.torch import load_file

        state = load_file(path)
        self._asyncrl_load(list(state.items()))
        return len(state)

    # ---- process-group receive (the weight broker) -------------------------------------
    def asyncrl_endpoint(self) -> ReceiverEndpoint:
        """This worker's one receiver endpoint: that of asyncrl's vLLM weight-transfer
        engine where vLLM built one (asyncrl/engine/vllm_transfer.py, ``broker.engine_api
        =vllm``), so both roads share groups and the held copy; else its own."""
        shadow = getattr(getattr(self, "weight_transfer_engine", None), "asyncrl_worker", None)
        if shadow is not None:
            return shadow.asyncrl_endpoint()
        rx = self.__dict__.get("_asyncrl_endpoint")
        if rx is None:
            rx = self.__dict__["_asyncrl_endpoint"] = ReceiverEndpoint()
        return rx

    def _asyncrl_rx(self) -> ReceiverEndpoint:
        return self.asyncrl_endpoint()

    def asyncrl_last_report(self) -> dict[str, Any] | None:
        """The report of this worker's last join or sync (a ReceiveReport as a dict): what
        vLLM's weight-update calls, which answer None, leave behind."""
        report = self._asyncrl_rx().last_report
        return None if report is None else dataclasses.asdict(report)

    def asyncrl_sync(self, spec: dict[str, Any], with_digests: bool = False) -> dict[str, Any]:
        """Take part in the next sync of group ``spec['key']`` and load it in place
        (generation paused by the caller). ``spec``: a JoinSpec's fields, ``rank`` the
        first rank of this engine's workers (each adds its own rank in the engine)."""
        join = JoinSpec.from_wire(spec)
        join = dataclasses.replace(join, rank=join.rank + int(getattr(self, "rank", 0)))
        report = self._asyncrl_rx().sync(
            join, self._asyncrl_load, with_digests, load_shard=self._asyncrl_load_shard
        )
        return dataclasses.asdict(report)

    @torch.no_grad()
    def _asyncrl_load_shard(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copy this worker's own shard (engine parameter names and shapes, from a
        resharded sync: asyncrl/transport/reshard.py) straight into its parameters: no
        full tensor, no slicing by vLLM's loaders. A vocabulary shard's padding rows are
        zeroed as vLLM's loader does; any other shape mismatch (a parameter vLLM padded
        or split otherwise than the plan) raises ValueError naming both shapes. A layer whose weight vLLM-CPU packed for its GEMM
        after loading (the plain weight dropped) gets the shard as its weight again and
        is packed anew (its ``process_weights_after_loading``), as the reload does."""
        model = self.model_runner.get_model()
        touched: dict[str, torch.nn.Module] = {}
        for name, t in tensors:
            module_name, _, leaf = name.rpartition(".")
            module = model.get_submodule(module_name)
            module = getattr(module, "base_layer", module)  # a LoRA wrapper's layer
            param = module.get_parameter(leaf)
            if param.numel() == 0 and t.numel():  # packed and dropped: the weight again
                setattr(module, leaf, torch.nn.Parameter(t.clone(), requires_grad=False))
            elif param.shape == t.shape:
                param.data.copy_(t)
            elif param.shape[1:] == t.shape[1:] and param.shape[0] >= t.shape[0]:
                # a vocabulary shard: the real rows, then zero padding
                param.data[: t.shape[0]].copy_(t)
                param.data[t.shape[0] :].zero_()
            else:
                raise ValueError(
                    f"resharded tensor {name}: shard shape {tuple(t.shape)} does not fit the "
                    f"engine parameter's {tuple(param.shape)}"
                )
            touched[module_name] = module
        for module in touched.values():
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
        self._asyncrl_retie()
        recorder = self.__dict__.get("_asyncrl_experts")
        if recorder is not None:
            recorder.bind()

    def asyncrl_spin_nap(self) -> float:
        """The nap this worker's vLLM queues use instead of spinning (0: vLLM's spin)."""
        return vllm_plugin.nap_in_effect()

    def _asyncrl_load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Reload ``tensors`` in place; a LoRA payload (``learner.lora``: adapter tensors
        only, asyncrl/engine/adapter.py) is merged into the base weights first."""
        if tensors and adapter.is_adapter_name(tensors[0][0]):
            packed = getattr(self.model_runner.get_model(), "packed_modules_mapping", None)
            tensors = adapter.merged_weights(tensors, self._asyncrl_base(), dict(packed or {}))
            with quiet(INPLACE_LOG, PartialReloadNotice()):
                self.model_runner.reload_weights(weights_iterator=iter(tensors))
        else:
            self.model_runner.reload_weights(weights_iterator=iter(tensors))
        self._asyncrl_retie()
        recorder = self.__dict__.get("_asyncrl_experts")
        if recorder is not None:
            recorder.bind()  # the reload may have rebuilt a layer's router

    # ---- routed experts (actor.record_experts; asyncrl/engine/experts.py) ---------------
    def asyncrl_record_experts(self) -> list[int]:
        """Record from now on the experts every MoE layer's router chooses, per request
        and position; returns ``[layers, top_k]`` of a record."""
        recorder = self.__dict__.get("_asyncrl_experts")
        if recorder is None:
            recorder = self.__dict__["_asyncrl_experts"] = ExpertRecorder(self.model_runner)
            shadow = getattr(getattr(self, "weight_transfer_engine", None), "asyncrl_worker", None)
            if shadow is not None:  # its reloads re-bind the recorder too
                shadow.__dict__["_asyncrl_experts"] = recorder
        return [recorder.book.layers, recorder.book.top_k]

    def asyncrl_take_experts(self, request_id: str, n: int) -> list[Any]:
        """The records of request ``request_id``'s ``n`` samples, dropped here: each
        ``[bytes, shape]`` of a uint8 ``[positions, layers, top_k]`` array (arrays do not
        cross ``collective_rpc`` whole), None where nothing was recorded."""
        recs = self.__dict__["_asyncrl_experts"].book.take(request_id, n)
        return [None if r is None else [r.tobytes(), list(r.shape)] for r in recs]

    def asyncrl_io_threads(self) -> list[int]:
        """The engine-core process's I/O threads where this worker runs inside it
        (asyncrl/engine/in_core.py), for the actor's placement; else none."""
        from asyncrl.engine import in_core

        return in_core.io_threads()

    def _asyncrl_base(self) -> adapter.BaseWeights:
        """The model directory's base weights LoRA payloads merge into (read on use)."""
        base = self.__dict__.get("_asyncrl_base_weights")
        if base is None:
            model_dir = self.model_runner.model_config.model
            base = self.__dict__["_asyncrl_base_weights"] = adapter.BaseWeights(model_dir)
        return base

    def asyncrl_clock(self) -> float:
        """This process's monotonic clock: the actor reads it just before the pause and
        just before the resume (in the engine core's input order) to time the engine's
        real pause."""
        import time

        return time.monotonic()

    def asyncrl_loaded_digests(self) -> dict[str, Any]:
        """Per-tensor digests of exactly what the last ``asyncrl_sync`` loaded
        (taken at load time when it was asked ``with_digests``)."""
        return self._asyncrl_rx().loaded_digests()

    def asyncrl_weight_state(self) -> dict[str, Any]:
        rx = self._asyncrl_rx()
        return {"held": rx.held_version, "loaded": rx.loaded_version}

    def asyncrl_close_groups(self, keys: list[str] | None = None) -> None:
        rx = self._asyncrl_rx()
        if keys is None:
            rx.close_all()
        for key in keys or []:
            rx.close(key)

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
