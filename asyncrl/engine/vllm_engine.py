"""The vLLM implementation of the engine seam (asyncrl/engine/protocol.py ``Engine``):
:class:`VLLMEngine` wraps a vLLM AsyncLLM whose workers carry asyncrl's worker extension
(worker_ext.py). Here vLLM's requests are built (sampling parameters, token prompts,
the renderer with its cache salt) and its RequestOutputs read into the seam's
:class:`~asyncrl.engine.protocol.Generation`.

This package is the only place that imports an engine library."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import os
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from asyncrl.engine import cpu_binding, launcher
from asyncrl.engine.protocol import Completion, Generation, Sampling
from asyncrl.engine.settings import EngineSettings
from asyncrl.engine.vllm_plugin import ENV as NAP_ENV
from asyncrl.transport.spec import JoinSpec, ReceiveReport


def make_engine(
    model_path: str, s: EngineSettings, seed: int = 0, record_experts: bool = False
) -> VLLMEngine:
    """Start a vLLM AsyncLLM whose workers carry asyncrl's worker extension;
    ``record_experts``: each completion carries the experts its MoE routers chose."""
    launcher.settle()  # a fork server being forked from here: before vLLM's imports
    os.environ.setdefault("VLLM_LOGGING_LEVEL", launcher.LOG_LEVEL)
    # read by asyncrl's vLLM plugin in the engine's processes, which inherit it
    os.environ[NAP_ENV] = repr(spin_nap(s))
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kwargs = engine_kwargs(model_path, s, seed)
    if on_cpu():  # several workers: each binds its OpenMP threads to its own cores
        cpu_binding.bind_workers(workers(kwargs))
    with launcher.engine_core_start(forks_engine_core(s, kwargs)):
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
    return VLLMEngine(llm, record_experts)


def engine_kwargs(model_path: str, s: EngineSettings, seed: int = 0) -> dict[str, Any]:
    """vLLM's EngineArgs for ``s``."""
    kwargs: dict[str, Any] = dict(
        model=model_path,
        dtype=s.dtype,
        max_model_len=s.max_model_len,
        max_num_seqs=s.max_num_seqs,
        enforce_eager=s.enforce_eager,
        enable_prefix_caching=s.enable_prefix_caching,
        disable_log_stats=s.disable_log_stats,
        # Log-probs of the distribution actually sampled from (after temperature,
        # top-k/top-p): the importance ratios need exactly these.
        logprobs_mode="processed_logprobs",
        worker_extension_cls="asyncrl.engine.worker_ext.AsyncRLWorkerExtension",
        seed=seed,
        tensor_parallel_size=s.tensor_parallel_size,
    )
    if on_cpu():
        kwargs["kv_cache_memory_bytes"] = s.kv_cache_memory_mb << 20
        # A prompt cut over two steps rewinds its seeded request's generator, which a CPU
        # generator cannot ("CPU Generator does not use offset": the engine dies). Unchunked,
        # a prompt waits for the next step instead, and vLLM raises the step's token budget
        # to at least max_model_len.
        kwargs["enable_chunked_prefill"] = False
    else:
        kwargs["gpu_memory_utilization"] = s.gpu_memory_utilization
    kwargs.update(s.extra or {})
    if worker_in_core(s, kwargs):
        kwargs["distributed_executor_backend"] = IN_CORE_EXECUTOR
    return kwargs


def forks_engine_core(s: EngineSettings, kwargs: dict[str, Any]) -> bool:
    """Whether the engine-core process is forked from the fork server
    (asyncrl/engine/launcher.py): asked for (``forkserver``), with the worker inside it."""
    return bool(s.forkserver and kwargs.get("distributed_executor_backend") == IN_CORE_EXECUTOR)


def warm_engine_start(s: EngineSettings) -> None:
    """Where this process's engines will fork their engine core and it is a Ray actor's
    own process (called first in its constructor), fork the fork server from it now, in
    the background (asyncrl/engine/launcher.py); elsewhere the first engine start spawns
    one."""
    if forks_engine_core(s, engine_kwargs("", s)) and launcher.own_actor_process():
        launcher.warm()


IN_CORE_EXECUTOR = "asyncrl.engine.in_core.InCoreExecutor"


def worker_in_core(s: EngineSettings, kwargs: dict[str, Any]) -> bool:
    """Whether the engine's one worker runs in the engine-core process: asked for
    (``in_core_worker``), on a CPU, one worker, no executor named in ``extra``."""
    return bool(
        s.in_core_worker
        and on_cpu()
        and workers(kwargs) == 1
        and "distributed_executor_backend" not in kwargs
        and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "1"
    )


def workers(kwargs: dict[str, Any]) -> int:
    """The engine's worker processes: its tensor- times pipeline-parallel ranks."""
    return int(kwargs.get("tensor_parallel_size", 1)) * int(kwargs.get("pipeline_parallel_size", 1))


CPU_SPIN_NAP_S = 0.0002  # a message waits <= ~0.4 ms; an idle reader costs ~12% of a core, not 100%


def spin_nap(s: EngineSettings) -> float:
    """Seconds vLLM's queue readers nap instead of spinning (0: vLLM's spin)."""
    if s.spin_nap_s is not None:
        return float(s.spin_nap_s)
    return CPU_SPIN_NAP_S if on_cpu() else 0.0


def vllm_params(s: Sampling) -> Any:
    """vLLM's SamplingParams of one request, only its final output. ``s.logprobs``: the
    sampled token's log-prob (in vLLM's flat layout: a few lists per sample instead of a
    dict and an object per token) and no text; else the text, no log-probs."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    if not s.logprobs:
        return SamplingParams(
            n=s.n,
            temperature=s.temperature,
            max_tokens=s.max_tokens,
            seed=s.seed,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
    # detokenize=False: vLLM's per-token incremental detokenizer and its decoding of
    # every log-prob's token cost the actor's process more CPU than all the rest of a
    # group's bookkeeping; the episode runner decodes each completion once instead.
    return SamplingParams(
        n=s.n,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k if s.top_k > 0 else -1,
        max_tokens=s.max_tokens,
        seed=s.seed,
        min_tokens=s.min_tokens,
        logprobs=0,
        flat_logprobs=True,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def tokens_prompt(ids: list[int]) -> Any:
    """A prompt given as token ids (the engine does not re-tokenize it)."""
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=ids)


def with_images(prompt: str | list[int], images: Sequence[bytes]) -> dict:
    """A prompt with its images (PNG bytes, decoded to RGB PIL images here) as vLLM's
    multi-modal data: vLLM's processor expands each placeholder into the image's tokens
    and hashes the pixels into the prefix cache's block keys."""
    from PIL import Image

    pil = [Image.open(io.BytesIO(png)).convert("RGB") for png in images]
    out: dict = {"prompt": prompt} if isinstance(prompt, str) else tokens_prompt(prompt)
    return {**out, "multi_modal_data": {"image": pil}}


class Renderer(Protocol):
    """A prompt (text or a TokensPrompt dict) and its cache salt (None: none) -> what
    ``engine.generate`` takes."""

    def __call__(self, prompt: str | dict, salt: str | None = None) -> Any: ...


def prompt_renderer(engine: Any) -> Renderer:
    """``(text or TokensPrompt, cache salt or None) -> what engine.generate takes``: the
    prompt rendered (text tokenized) by the engine's own renderer, as vLLM asks since it
    deprecated raw prompts, carrying ``cache_salt`` (:func:`version_salt`) when given. On
    a vLLM without that renderer API, the prompt dict itself (``{"prompt": text}`` for
    text), which it takes instead."""
    renderer = getattr(engine, "renderer", None)
    try:
        from vllm.renderers.inputs.preprocess import parse_model_prompt
    except ImportError:
        parse_model_prompt = None

    def as_dict(prompt: str | dict, salt: str | None) -> dict:
        out = {"prompt": prompt} if isinstance(prompt, str) else dict(prompt)
        if salt:
            out["cache_salt"] = salt  # kept by the renderer's tokenization (its dict keys)
        return out

    if renderer is None or parse_model_prompt is None:
        return lambda prompt, salt=None: as_dict(prompt, salt)
    model_config = engine.model_config
    tok_params = renderer.default_cmpl_tok_params

    def render(prompt: str | dict, salt: str | None = None) -> Any:
        parsed = parse_model_prompt(model_config, as_dict(prompt, salt))
        (out,) = renderer.render_cmpl([parsed], tok_params)
        return out

    return render


def on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def completion_arrays(comp, version_fallback: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token ids, behaviour log-probs, versions) of one vLLM CompletionOutput, whose
    log-probs are vLLM's ``FlatLogprobs`` (``flat_logprobs=True``: the sampled token
    first at each position) or its list of ``{token: Logprob}`` dicts.

    vLLM labels contiguous spans of output tokens with the weight version that was
    current in the engine when each token was produced (set by
    ``update_weight_version`` while generation is paused), so versions are exact
    even when a sequence spans an update.
    """
    ids = np.asarray(comp.token_ids, dtype=np.int32)
    steps = comp.logprobs
    if steps is None or len(steps) != len(ids):
        raise RuntimeError(
            "vLLM returned no per-token log-probs; SamplingParams.logprobs must be 0"
        )
    if hasattr(steps, "start_indices"):  # FlatLogprobs: plain lists, no per-token objects
        first = np.asarray(steps.start_indices, dtype=np.intp)
        if len(ids) and not np.array_equal(np.asarray(steps.token_ids)[first], ids):
            raise RuntimeError("vLLM's log-probs do not list the sampled token first")
        lps = np.asarray(steps.logprobs, dtype=np.float32)[first]
    else:
        lps = np.asarray([step[int(t)].logprob for step, t in zip(steps, ids)], dtype=np.float32)
    return ids, lps, token_versions(comp, len(ids), version_fallback)


def token_versions(comp: Any, n: int, version_fallback: int) -> np.ndarray:
    """Each output token's weight version from vLLM's spans; ``version_fallback`` where
    a span carries no asyncrl label (an engine never labelled, e.g. the judge's: vLLM's
    "default")."""
    versions = np.full(n, version_fallback, dtype=np.int32)
    for span in comp.weight_versions or []:
        if str(span.version).lstrip("-").isdigit():
            versions[span.start : span.end] = int(span.version)
    return versions


def completion(comp: Any, version_fallback: int, logprobs: bool) -> Completion:
    """One vLLM CompletionOutput as the seam's :class:`Completion`."""
    if logprobs:
        ids, lps, versions = completion_arrays(comp, version_fallback)
    else:
        ids, lps = np.asarray(comp.token_ids, dtype=np.int32), None
        versions = token_versions(comp, len(ids), version_fallback)
    text = comp.text if not logprobs else ""
    return Completion(int(comp.index), ids, lps, versions, str(comp.finish_reason), text or "")


# Bound on the control calls with no deadline of their own (the clock reading); a live
# engine answers in ms.
CONTROL_TIMEOUT_S = 60.0


class VLLMEngine:
    """:class:`~asyncrl.engine.protocol.Engine` over a vLLM ``AsyncLLM`` (``llm``).

    ``version`` is the label last set (:meth:`label`): it labels any token vLLM left
    unlabelled. Each call sends its message to the engine core in its first slice
    (the callers rely on the order: actor/weights.py).

    ``record_experts``: the workers record each request's routed experts
    (asyncrl/engine/experts.py, switched on before the first request) and
    :meth:`generate` takes them once the request is done: one more call to the engine
    core per request, answered between two model steps."""

    def __init__(self, llm: Any, record_experts: bool = False):
        self.llm = llm
        self.record_experts = record_experts
        self._recording: asyncio.Future | None = None
        self.seed: int | None = getattr(getattr(llm, "model_config", None), "seed", None)
        self.version = 0
        # keep: straight to the engine core (see pause), whose workers' clocks then mark
        # when it read the pause and the resume
        self.timed_pause = hasattr(getattr(llm, "engine_core", None), "pause_scheduler_async")
        self._render: Renderer | None = None
        self._shut = False

    @property
    def errored(self) -> bool:
        """Never to serve again: shut down, or vLLM's monitor saw its processes die."""
        return self._shut or bool(getattr(self.llm, "errored", False))

    async def generate(
        self, prompt: str | list[int], sampling: Sampling, request_id: str,
        salt: str | None = None, images: Sequence[bytes] = (),
    ) -> Generation:  # fmt: skip
        if self._render is None:
            self._render = prompt_renderer(self.llm)
        request = self._render(with_images(prompt, images) if images else (
            prompt if isinstance(prompt, str) else tokens_prompt(prompt)), salt)  # fmt: skip
        if self.record_experts:
            if self._recording is None:  # once, before any request of this engine
                self._recording = asyncio.ensure_future(
                    self.call_workers("asyncrl_record_experts", None, CONTROL_TIMEOUT_S)
                )
            await self._recording
        final = None
        async for out in self.llm.generate(request, vllm_params(sampling), request_id=request_id):
            final = out
        # (a request that raised leaves its records behind: the recorder drops them later)
        routes = await self.take_experts(request_id, sampling.n)
        if final is None:  # aborted before any output
            return Generation([], [])
        version = self.version
        comps = [completion(c, version, sampling.logprobs) for c in final.outputs]
        for c in comps:
            c.routed_experts = routes[c.index]
        return Generation(
            list(final.prompt_token_ids or []), comps, int(final.num_cached_tokens or 0)
        )

    async def take_experts(self, request_id: str, n: int) -> list[np.ndarray | None]:
        """Each sample's routed experts from the first worker (every worker of a
        tensor-parallel engine routes alike); Nones when not recording."""
        if not self.record_experts:
            return [None] * n
        got = await self.call_workers(
            "asyncrl_take_experts", {"request_id": request_id, "n": n}, CONTROL_TIMEOUT_S
        )
        return [
            None if r is None else np.frombuffer(r[0], dtype=np.uint8).reshape(r[1]).copy()
            for r in got[0]
        ]

    def get_tokenizer(self) -> Any:
        return self.llm.get_tokenizer()

    async def pause(self, mode: str) -> None:
        """``pause_generation(mode)``; for ``keep`` straight to the engine core:
        ``pause_generation`` then sleeps 20 ms so that outputs already made reach their
        streams first (its comment: "not required for correctness"), 20 ms of every
        update's pause. With ``keep`` nothing is lost or reordered: those outputs still
        arrive, labelled with the version that made them."""
        if mode == "keep" and self.timed_pause:
            await self.llm.engine_core.pause_scheduler_async(mode=mode, clear_cache=False)
        else:
            await self.llm.pause_generation(mode=mode, clear_cache=mode != "keep")

    async def resume(self) -> None:
        await self.llm.resume_generation()

    async def label(self, version: int) -> None:
        await self.llm.update_weight_version(str(version))
        self.version = int(version)

    async def reset_prefix_cache(self, running: bool = False) -> None:
        await self.llm.reset_prefix_cache(reset_running_requests=running)

    async def worker_clocks(self) -> list[float]:
        return await self.call_workers("asyncrl_clock", None, CONTROL_TIMEOUT_S)

    async def receive_weights(
        self, spec: JoinSpec, with_digests: bool, timeout_s: float
    ) -> list[ReceiveReport]:
        kwargs = {"spec": dataclasses.asdict(spec), "with_digests": with_digests}
        got = await self.call_workers("asyncrl_sync", kwargs, timeout_s)
        await self.forget_encoder_outputs()
        return [ReceiveReport.from_wire(r) for r in got]

    async def receive_weights_via_engine(
        self, spec: JoinSpec, version: int, with_digests: bool, timeout_s: float
    ) -> list[ReceiveReport]:
        """The same receive through vLLM's weight-update API (the engine started with
        asyncrl's transfer backend, asyncrl/engine/vllm_transfer.py): init (join group
        ``spec.key`` on first use), start, update (receive and reload in place), finish
        with ``weight_version`` ``version``, then the workers' reports. The calls go out
        together, in order (the engine core runs them in turn); a failed one fails the
        later ones fast, and the reports say where it failed."""
        from vllm.distributed.weight_transfer.base import (
            WeightTransferInitRequest,
            WeightTransferUpdateRequest,
        )

        init = WeightTransferInitRequest(dataclasses.asdict(spec))
        update = {"key": spec.key, "with_digests": with_digests}
        calls = [
            self.llm.init_weight_transfer_engine(init),
            self.llm.start_weight_update(),
            self.llm.update_weights(WeightTransferUpdateRequest(update)),
            self.llm.finish_weight_update(weight_version=str(version)),
            self.call_workers("asyncrl_last_report", None, timeout_s),
        ]
        tasks = []
        for c in calls:  # each sends its message in its first slice
            tasks.append(asyncio.ensure_future(c))
            await asyncio.sleep(0)
        got = await asyncio.gather(*tasks, return_exceptions=True)
        reports, errors = got[-1], [g for g in got if isinstance(g, BaseException)]
        if isinstance(reports, BaseException) or any(r is None for r in reports):
            raise errors[0]
        out = [ReceiveReport.from_wire(r) for r in reports]
        if errors and all(r.ok for r in out):  # loaded, but the version was not set
            raise errors[0]
        await self.forget_encoder_outputs()
        return out

    async def weight_version(self) -> str:
        """vLLM's committed weight version (what its outputs are stamped with)."""
        return await self.llm.get_weight_version()

    async def load_weights_file(self, path: str, timeout_s: float) -> None:
        await self.call_workers("asyncrl_load_file", {"path": path}, timeout_s)
        await self.forget_encoder_outputs()

    async def forget_encoder_outputs(self) -> None:
        """After a reload, a multi-modal model's cached image features are stale: vLLM's
        reload clears the workers' encoder cache but not the scheduler's record of it,
        which then schedules no encoder run for an image it believes cached (vLLM:
        "Encoder cache miss", the engine dies). Clear both (generation is paused: the
        scheduler runs again its encoder for a request still prefilling)."""
        if getattr(getattr(self.llm, "model_config", None), "is_multimodal_model", False):
            await self.llm.reset_encoder_cache()

    async def weight_states(self, timeout_s: float) -> list[dict[str, int]]:
        return await self.call_workers("asyncrl_weight_state", None, timeout_s)

    async def close_weight_groups(self, keys: list[str] | None, timeout_s: float) -> None:
        await self.call_workers("asyncrl_close_groups", {"keys": keys}, timeout_s)

    async def call_workers(
        self, method: str, kwargs: dict[str, Any] | None, timeout_s: float
    ) -> list[Any]:
        return await self.llm.collective_rpc(method, timeout=timeout_s, kwargs=kwargs or {})

    def shutdown(self) -> None:
        """Stop the engine's processes (once; a second call does nothing)."""
        if not self._shut:
            self._shut = True
            self.llm.shutdown()
