"""The SGLang implementation of the engine seam (asyncrl/engine/protocol.py ``Engine``):
:class:`SGLangEngine` wraps SGLang's offline ``sglang.Engine`` (its tokenizer manager in
this process, its scheduler and detokenizer in processes of their own). Written against
SGLang 0.5.23's source and held to the engine contract by a fake of that Engine
(tests/fake_sglang.py); it has never run against a real SGLang (docs/engines.md, SGLang).

    generate(ids, Sampling)  ─▶ async_generate(input_ids=[ids] * n, one sampling_seed
                                per sample, return_logprob, rid, cache_salt)
    ◀── one dict per sample: output_ids, meta_info{finish_reason, output_token_logprobs
        [(logprob, id, text)], weight_versions [{version, start, end}], cached_tokens}
    pause / resume            ─▶ tokenizer manager pause_generation / continue_generation
    label(V)                  ─▶ update_weight_version (no abort)
    load_weights_file(path)   ─▶ begin_weight_update, update_weights_from_tensor, end

Only this module imports sglang, and only inside functions.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from asyncrl.engine.protocol import Completion, Generation, Sampling
from asyncrl.engine.settings import EngineSettings
from asyncrl.transport.spec import JoinSpec, ReceiveReport

SEED_SPAN = 1 << 63  # SGLang's sampling_seed must lie in [-2**63, 2**63 - 1]


def importable() -> bool:
    """Whether ``import sglang`` can find the package (nothing is imported)."""
    return importlib.util.find_spec("sglang") is not None


def make_engine(model_path: str, s: EngineSettings, seed: int = 0) -> SGLangEngine:
    """Start SGLang's offline Engine on ``model_path`` (its processes load the model)."""
    import sglang

    return SGLangEngine(
        sglang.Engine(**server_kwargs(model_path, s, seed)), s.enable_prefix_caching
    )


def server_kwargs(model_path: str, s: EngineSettings, seed: int = 0) -> dict[str, Any]:
    """SGLang's ServerArgs for ``s``: the keys with an SGLang equivalent, then ``extra``
    (any other ServerArgs field). vLLM-only keys (kv_cache_memory_mb, spin_nap_s,
    in_core_worker, forkserver, disable_log_stats) have none and are unused."""
    from asyncrl.engine.vllm_engine import on_cpu

    kwargs: dict[str, Any] = dict(
        model_path=model_path,
        dtype=s.dtype,
        context_length=s.max_model_len,
        max_running_requests=s.max_num_seqs,
        random_seed=seed,
        tp_size=s.tensor_parallel_size,
        disable_cuda_graph=s.enforce_eager,
        disable_radix_cache=not s.enable_prefix_caching,
        log_level="error",
    )
    if on_cpu():
        kwargs["device"] = "cpu"
    else:
        kwargs["mem_fraction_static"] = s.gpu_memory_utilization
    kwargs.update(s.extra or {})
    return kwargs


def sampling_params(s: Sampling, sample: int) -> dict[str, Any]:
    """SGLang's sampling_params of sample ``sample`` of a request: SGLang gives every
    copy of an ``n > 1`` request the same ``sampling_seed`` (tokenizer_manager.py,
    ``_handle_batch_request``), so each sample is a request of its own, seeded
    ``seed + sample`` as vLLM seeds its ``n`` samples."""
    p: dict[str, Any] = {"max_new_tokens": s.max_tokens, "temperature": s.temperature}
    if s.logprobs:
        p.update(top_p=s.top_p, top_k=s.top_k if s.top_k > 0 else -1, min_new_tokens=s.min_tokens)
    if s.seed is not None:
        p["sampling_seed"] = (s.seed + sample) % SEED_SPAN
    return p


def token_versions(meta: dict[str, Any], n: int, version_fallback: int) -> np.ndarray:
    """Each output token's weight version from SGLang's ``meta_info["weight_versions"]``
    spans; ``version_fallback`` where a span carries no asyncrl label (SGLang's
    ``"default"``, an engine never labelled)."""
    versions = np.full(n, version_fallback, dtype=np.int32)
    for span in meta.get("weight_versions") or []:
        if str(span["version"]).lstrip("-").isdigit():
            versions[span["start"] : span["end"]] = int(span["version"])
    return versions


def completion(
    index: int, out: dict[str, Any], version_fallback: int, logprobs: bool
) -> Completion:
    """One sample's output dict (``output_ids``, ``text``, ``meta_info``) as the seam's
    :class:`Completion`. ``output_ids`` keep a matched stop token (only ``text`` is
    trimmed: detokenizer_manager.py ``trim_matched_stop``)."""
    meta = out["meta_info"]
    ids = np.asarray(out["output_ids"], dtype=np.int32)
    lps = None
    if logprobs:
        steps = meta.get("output_token_logprobs") or []
        if len(steps) != len(ids) or any(int(t) != i for (_, t, _), i in zip(steps, ids)):
            raise RuntimeError("SGLang's output_token_logprobs do not match its output_ids")
        lps = np.asarray([lp for lp, _, _ in steps], dtype=np.float32)
    finish = meta.get("finish_reason") or {}
    text = "" if logprobs else out.get("text") or ""
    versions = token_versions(meta, len(ids), version_fallback)
    return Completion(index, ids, lps, versions, str(finish.get("type", "abort")), text)


class SGLangEngine:
    """:class:`~asyncrl.engine.protocol.Engine` over an ``sglang.Engine`` (``eng``).

    The async calls go to its tokenizer manager (``eng.tokenizer_manager``), as the
    Engine's own synchronous wrappers do with ``run_until_complete``, which cannot run
    inside the actor's event loop. Update modes: ``abort`` is SGLang's ``abort``;
    ``keep`` is ``in_place`` (requests keep their KV), or ``retract`` with prefix
    caching on (their KV is dropped and recomputed on the new weights, so the cache can
    be flushed); ``wait`` holds new requests here and waits for those in flight, which
    SGLang has no mode for. ``prefix_caching``: SGLang's radix cache is on, and a load
    flushes it."""

    def __init__(self, eng: Any, prefix_caching: bool = False):
        self.eng = eng
        self.prefix_caching = prefix_caching
        self.seed: int | None = getattr(eng.server_args, "random_seed", None)
        self.version = 0
        self.timed_pause = False  # SGLang's scheduler reports no clock
        self._open = asyncio.Event()  # cleared by a ``wait`` pause
        self._open.set()
        self._idle = asyncio.Event()  # no request of this engine in flight
        self._idle.set()
        self._inflight = 0
        self._waited = False  # the pause in effect is a ``wait`` (this class's own)
        self._shut = False

    @property
    def errored(self) -> bool:
        """Never to serve again: shut down, or one of SGLang's processes is gone (its
        watchdog then sends this process SIGQUIT)."""
        if self._shut:
            return True
        import psutil

        for pid in self.eng.get_all_child_pids():
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    return True
            except psutil.NoSuchProcess:
                return True
        return False

    async def generate(
        self, prompt: str | list[int], sampling: Sampling, request_id: str,
        salt: str | None = None, images: Sequence[bytes] = (),
    ) -> Generation:  # fmt: skip
        if images:
            raise ValueError("the sglang backend takes no images (docs/engines.md)")
        if self._shut:
            raise RuntimeError("the engine is shut down")
        # tokenized here as SGLang's tokenizer manager would (tokenizer(text)): the ids
        # sent are the prompt ids returned
        ids = (
            list(prompt) if isinstance(prompt, list) else list(self.get_tokenizer().encode(prompt))
        )
        await self._open.wait()
        self._inflight += 1
        self._idle.clear()
        try:
            outs = await self.eng.async_generate(
                input_ids=[ids] * sampling.n,
                sampling_params=[sampling_params(sampling, i) for i in range(sampling.n)],
                return_logprob=sampling.logprobs,
                rid=[f"{request_id}-{i}" for i in range(sampling.n)],
                cache_salt=salt,
            )
        finally:
            self._inflight -= 1
            if not self._inflight:
                self._idle.set()
        comps = [completion(i, o, self.version, sampling.logprobs) for i, o in enumerate(outs)]
        cached = int(outs[0]["meta_info"].get("cached_tokens") or 0) if outs else 0
        return Generation(ids, comps, cached)

    def get_tokenizer(self) -> Any:
        return self.eng.tokenizer_manager.tokenizer

    async def pause(self, mode: str) -> None:
        if mode == "wait":
            self._open.clear()
            self._waited = True
            await self._idle.wait()
            return
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        how = "abort" if mode == "abort" else "retract" if self.prefix_caching else "in_place"
        await self.eng.tokenizer_manager.pause_generation(PauseGenerationReqInput(mode=how))

    async def resume(self) -> None:
        if self._waited:
            self._waited = False
            self._open.set()
            return
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        await self.eng.tokenizer_manager.continue_generation(ContinueGenerationReqInput())

    async def label(self, version: int) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        obj = UpdateWeightVersionReqInput(new_version=str(version), abort_all_requests=False)
        await self.eng.tokenizer_manager.update_weight_version(obj)
        self.version = int(version)

    async def reset_prefix_cache(self, running: bool = False) -> None:
        """SGLang's ``flush_cache``, which refuses while requests hold KV (under ``keep``
        with prefix caching they were retracted first)."""
        out = await self.eng.tokenizer_manager.flush_cache()
        if not out.success:
            raise RuntimeError(f"SGLang did not flush its cache: {out.message}")

    async def worker_clocks(self) -> list[float]:
        """This process's clock (``timed_pause`` is False: SGLang reports none)."""
        return [time.monotonic()]

    async def load_weights_file(self, path: str, timeout_s: float) -> None:
        """The safetensors file through SGLang's own update API: one weight-update
        session (begin, update_weights_from_tensor, end). The radix cache is flushed
        with prefix caching on (the requests were retracted, aborted or finished)."""
        from safetensors.torch import load_file
        from sglang.srt.managers.io_struct import (
            BeginWeightUpdateReqInput,
            EndWeightUpdateReqInput,
            UpdateWeightsFromTensorReqInput,
        )
        from sglang.srt.utils import MultiprocessingSerializer

        tm = self.eng.tokenizer_manager
        named = list(load_file(path).items())
        # one payload per tensor-parallel rank, as Engine.update_weights_from_tensor sends
        payload = [MultiprocessingSerializer.serialize(named) for _ in range(self._tp_size())]
        update = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=payload, flush_cache=self.prefix_caching
        )

        async def session() -> None:
            await answered(tm.begin_weight_update(BeginWeightUpdateReqInput(), None))
            try:
                await answered(tm.update_weights_from_tensor(update, None))
            finally:
                await answered(tm.end_weight_update(EndWeightUpdateReqInput(), None))

        await asyncio.wait_for(session(), timeout_s)

    def _tp_size(self) -> int:
        return int(getattr(self.eng.server_args, "tp_size", 1))

    async def receive_weights(
        self, spec: JoinSpec, with_digests: bool, timeout_s: float
    ) -> list[ReceiveReport]:
        raise NotImplementedError(NO_WORKERS)

    async def receive_weights_via_engine(
        self, spec: JoinSpec, version: int, with_digests: bool, timeout_s: float
    ) -> list[ReceiveReport]:
        raise NotImplementedError(NO_WORKERS)

    async def weight_states(self, timeout_s: float) -> list[dict[str, int]]:
        """One "worker": the version loaded; no copy held for deltas (-1)."""
        return [{"held": -1, "loaded": self.version}]

    async def close_weight_groups(self, keys: list[str] | None, timeout_s: float) -> None:
        """No broker groups: nothing to close."""

    async def call_workers(
        self, method: str, kwargs: dict[str, Any] | None, timeout_s: float
    ) -> list[Any]:
        raise NotImplementedError(f"{NO_WORKERS} (asked for {method})")

    def shutdown(self) -> None:
        """Stop SGLang's processes (once). SGLang's shutdown kills every child process of
        this process, not only its own."""
        if not self._shut:
            self._shut = True
            self.eng.shutdown()


NO_WORKERS = (
    "the sglang backend has no asyncrl worker extension: weights arrive through "
    "SGLang's update_weights_from_tensor (broker=objectstore)"
)


async def answered(call: Any) -> None:
    """Await one of SGLang's ``(success, message)`` control calls; raise on failure."""
    ok, message = await call
    if not ok:
        raise RuntimeError(f"SGLang refused the weight update: {message}")
