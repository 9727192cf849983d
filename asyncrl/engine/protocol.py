"""The engine seam: what the actor, the judge and eval need from an inference engine.

    caller                         Engine                          engine's processes
    generate(prompt, Sampling,  ─▶ render (text or token ids,   ─▶ sample, label each
             request_id, salt,     cache salt, images) and         token with the weights'
             images)               submit
    ◀── Generation (prompt ids, one Completion per sample:         version
        token ids, log-probs, per-token versions, finish reason)
    pause(mode) / label(V) / reset_prefix_cache() / resume()    a weight update's steps
    receive_weights(spec) / load_weights_file(path) / ...       the worker extension's calls
    errored, shutdown()

:class:`Engine` is the one Protocol; ``vllm_engine.VLLMEngine`` implements it over vLLM's
AsyncLLM, ``sglang_engine.SGLangEngine`` over SGLang's offline Engine, tests/fake_engine.py
``FakeEngine`` for unit tests. Pure Python: no engine
library is imported here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from asyncrl.engine.settings import SamplingSettings
from asyncrl.transport.spec import JoinSpec, ReceiveReport

# Group j of a run with seed s samples with seed s * GROUP_SEED_STRIDE + j * n; the engine
# gives sample i of it seed + i, so no two samples of a run share a seed, and runs with
# different seeds share none until a run passes 2**32 / n groups.
GROUP_SEED_STRIDE = 1 << 32


@dataclass(frozen=True)
class Sampling:
    """One request's sampling. ``logprobs``: the sampled tokens' behaviour log-probs (of
    the distribution actually sampled from), token ids only (no text); False: the text of
    each sample, no log-probs, plain temperature sampling (``top_p``/``top_k`` unused:
    the judge's and eval's requests)."""

    n: int = 1
    temperature: float = 1.0
    max_tokens: int = 16
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None  # None: the engine's own generator
    logprobs: bool = True
    min_tokens: int = 0  # stop tokens masked until this many are out (benchmarks' long answers)

    def with_seed(self, seed: int | None) -> Sampling:
        return replace(self, seed=seed)


def policy_sampling(s: SamplingSettings) -> Sampling:
    """``actor.sampling`` as a request's :class:`Sampling` (the actor's groups)."""
    return Sampling(s.n, s.temperature, s.max_tokens, s.top_p, s.top_k, None, True)


def text_sampling(temperature: float, max_tokens: int, n: int = 1, seed: int | None = None):
    """Plain sampling of ``n`` texts (the judge's and eval's requests)."""
    return Sampling(n, temperature, max_tokens, seed=seed, logprobs=False)


@dataclass
class Completion:
    """One sample of a request. Arrays have one entry per generated token:
    ``token_ids`` int32, ``logprobs`` float32 (None when not asked), ``versions`` int32
    (the policy version of the weights that sampled each token: a sequence may span an
    update). ``finish_reason``: "stop", "length" or "abort" (a weight update under
    ``abort`` cut it short). ``text``: the decoded text when asked (``logprobs=False``).
    ``routed_experts``: uint8 ``[positions, moe layers, top_k]``, the experts the engine's
    routers chose for prompt + generated tokens as model input (an engine recording
    them: ``actor.record_experts``; else None)."""

    index: int
    token_ids: np.ndarray
    logprobs: np.ndarray | None
    versions: np.ndarray
    finish_reason: str
    text: str = ""
    routed_experts: np.ndarray | None = None


@dataclass
class Generation:
    """What one request returned: its prompt's token ids (as the engine tokenized it),
    one :class:`Completion` per sample (in sample order), and how many prompt tokens the
    engine read from its prefix cache."""

    prompt_ids: list[int]
    completions: list[Completion]
    cached_tokens: int = 0

    @property
    def aborted(self) -> bool:
        return any(c.finish_reason == "abort" for c in self.completions)


class Engine(Protocol):
    """An inference engine as the actor, the judge and eval drive it.

    ``generate(..., images)``: PNG bytes of the images the prompt's placeholders stand
    for, in order (a multi-modal model's prompt); the engine expands each placeholder
    into the image's tokens, and ``Generation.prompt_ids`` are the expanded ids.

    ``seed``: the run's seed the engine was built with (None: unseeded), from which the
    callers derive each request's seed. ``errored``: the engine can never serve again
    (its processes died). ``version``: the label its tokens carry now.

    Weight updates: ``pause(mode)`` (``abort``: requests in flight end with
    ``finish_reason="abort"``; ``wait``: they finish first; ``keep``: they freeze and
    continue on the new weights), then a load, then ``label(V)`` (every token sampled
    from then on carries V), optionally ``reset_prefix_cache()``, then ``resume()``.
    Each call sends its message to the engine in its first slice, so calls started in
    turn reach the engine in that order. ``worker_clocks()`` reads each worker's
    monotonic clock in the same order (``timed_pause``: whether it means anything).

    Weights arrive through the worker-side receiver (``receive_weights``: join the
    broker's group, receive and reload in place, one report per worker;
    ``receive_weights_via_engine``: the same through the engine's own weight-update API,
    which also sets the engine's weight version to ``version``;
    ``load_weights_file``: a safetensors file), ``weight_states`` ({"held", "loaded"}
    per worker), ``close_weight_groups``; ``call_workers`` calls any other method of
    the workers (diagnostics: checksums, the nap in effect).
    """

    seed: int | None
    version: int
    timed_pause: bool

    @property
    def errored(self) -> bool: ...

    async def generate(
        self, prompt: str | list[int], sampling: Sampling, request_id: str,
        salt: str | None = None, images: Sequence[bytes] = (),
    ) -> Generation: ...  # fmt: skip

    def get_tokenizer(self) -> Any: ...

    async def pause(self, mode: str) -> None: ...

    async def resume(self) -> None: ...

    async def label(self, version: int) -> None: ...

    async def reset_prefix_cache(self, running: bool = False) -> None: ...

    def worker_clocks(self) -> Awaitable[list[float]]: ...

    # receiving weights: the worker extension's calls (asyncrl/engine/worker_ext.py)
    async def receive_weights(
        self, spec: JoinSpec, with_digests: bool, timeout_s: float
    ) -> list[ReceiveReport]: ...

    async def receive_weights_via_engine(
        self, spec: JoinSpec, version: int, with_digests: bool, timeout_s: float
    ) -> list[ReceiveReport]: ...

    async def load_weights_file(self, path: str, timeout_s: float) -> None: ...

    async def weight_states(self, timeout_s: float) -> list[dict[str, int]]: ...

    async def close_weight_groups(self, keys: list[str] | None, timeout_s: float) -> None: ...

    async def call_workers(
        self, method: str, kwargs: dict[str, Any] | None, timeout_s: float
    ) -> list[Any]: ...

    def shutdown(self) -> None: ...


def version_salt(version: int) -> str:
    """The prefix-cache salt of a request made while the engine's weights carry policy
    ``version``. The engine hashes a request's salt into its first KV block's hash, and
    every later block's hash chains from it: a request salted with one version never
    reads a cached block of a request salted with another, while requests of one version
    still share prefixes."""
    return f"policy-v{int(version)}"


def group_sampling(engine: Engine, sampling: Sampling, index: int) -> Sampling:
    """``sampling`` with the group's own seed, from the engine's seed (the run's
    ``seed``) and ``index``, the group's place in the order the actor started them: what
    a group samples then does not depend on which other requests share the engine's
    batches (with one generator for all, it does). An engine with no seed: ``sampling``."""
    if engine.seed is None:
        return sampling
    return sampling.with_seed((engine.seed * GROUP_SEED_STRIDE + index * sampling.n) % (1 << 63))
