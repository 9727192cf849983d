"""Building a vLLM engine (for an actor, the judge or eval), the sampling parameters of
its requests, its token prompts, and reading per-token data out of its results.

This package is the only place that imports an engine library."""

from __future__ import annotations

import os
from typing import Any, Protocol

import numpy as np

from asyncrl.engine.settings import EngineSettings, SamplingSettings
from asyncrl.engine.vllm_plugin import ENV as NAP_ENV


def make_engine(model_path: str, s: EngineSettings, seed: int = 0):
    """Start a vLLM AsyncLLM whose workers carry asyncrl's worker extension."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # read by asyncrl's vLLM plugin in the engine's processes, which inherit it
    os.environ[NAP_ENV] = repr(spin_nap(s))
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

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
    )
    if on_cpu():
        kwargs["kv_cache_memory_bytes"] = s.kv_cache_memory_mb << 20
    else:
        kwargs["gpu_memory_utilization"] = s.gpu_memory_utilization
    kwargs.update(s.extra or {})
    return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))


CPU_SPIN_NAP_S = 0.0002  # a message waits <= ~0.4 ms; an idle reader costs ~12% of a core, not 100%


def spin_nap(s: EngineSettings) -> float:
    """Seconds vLLM's queue readers nap instead of spinning (0: vLLM's spin)."""
    if s.spin_nap_s is not None:
        return float(s.spin_nap_s)
    return CPU_SPIN_NAP_S if on_cpu() else 0.0


def sampling_params(s: SamplingSettings) -> Any:
    """The vLLM SamplingParams of every group: ``s.n`` samples, the sampled token's
    log-prob (in vLLM's flat layout: a few lists per sample instead of a dict and an
    object per token), only the final output."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    # detokenize=False: vLLM's per-token incremental detokenizer and its decoding of
    # every log-prob's token cost the actor's process more CPU than all the rest of a
    # group's bookkeeping; the episode runner decodes each completion once instead.
    return SamplingParams(
        n=s.n,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k if s.top_k > 0 else -1,
        max_tokens=s.max_tokens,
        logprobs=0,
        flat_logprobs=True,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


# Group j of a run with seed s samples with seed s * GROUP_SEED_STRIDE + j * n; vLLM gives
# sample i of it seed + i, so no two samples of a run share a seed, and runs with
# different seeds share none until a run passes 2**32 / n groups.
GROUP_SEED_STRIDE = 1 << 32


def text_params(temperature: float, max_tokens: int, n: int = 1, seed: int | None = None) -> Any:
    """Plain sampling of ``n`` texts (the judge's and eval's requests): only the final
    output, no log-probs."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=n,
        temperature=temperature,
        max_tokens=max_tokens,
        seed=seed,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def tokens_prompt(ids: list[int]) -> Any:
    """A prompt given as token ids (the engine does not re-tokenize it)."""
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=ids)


def version_salt(version: int) -> str:
    """The prefix-cache salt of a request made while the engine's weights carry policy
    ``version``. vLLM hashes a request's salt into its first KV block's hash, and every
    later block's hash chains from it: a request salted with one version never reads a
    cached block of a request salted with another, while requests of one version still
    share prefixes."""
    return f"policy-v{int(version)}"


def group_params(engine: Any, params: Any, index: int) -> Any:
    """``params`` with the group's own sampling seed, from the engine's seed (the run's
    ``seed``) and ``index``, the group's place in the order the actor started them: what
    a group samples then does not depend on which other requests share the engine's
    batches (with one generator for all, it does). An engine with no seed: ``params``."""
    seed = getattr(getattr(engine, "model_config", None), "seed", None)
    if seed is None:
        return params
    seeded = params.clone()
    seeded.seed = (seed * GROUP_SEED_STRIDE + index * params.n) % (1 << 63)
    return seeded


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
    versions = np.full(len(ids), version_fallback, dtype=np.int32)
    for span in comp.weight_versions or []:
        versions[span.start : span.end] = int(span.version)
    return ids, lps, versions
