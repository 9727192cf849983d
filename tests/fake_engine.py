"""FakeEngine: the engine seam (asyncrl/engine/protocol.py ``Engine``) in-process, for
unit tests. What it samples, one token per event-loop turn:

* with ``policy(prompt_ids) -> text``: that text's tokens, then EOS ("stop"), cut at
  ``max_tokens`` ("length"); every log-prob ``logprob``;
* without: a toy model, each token a hash of (its weights, the request's seed or a
  counter, the prompt, the sample, the position) over ``vocab``, never EOS: exactly
  ``max_tokens`` tokens ("length"), log-probs in (-5, 0).

Each token carries the label set last (``label``). ``pause(mode)`` holds every request
before its next token until ``resume()``; under ``abort`` the requests in flight end
with ``finish_reason="abort"``. With ``expand``, a request with images reports the
prompt ids ``expand(ids, images)`` gives (what vLLM's processor makes of the image
placeholders). ``load_weights_file`` changes the toy model's weights (a
digest of the file), ``receive_weights`` calls ``receiver(spec, with_digests)`` (None:
a report of ``spec`` received). ``log`` records every control call in order.

Import it as ``from fake_engine import FakeEngine`` (pytest puts tests/ on ``sys.path``);
Ray's workers get the class by value (registered below).
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from ray import cloudpickle

from asyncrl.engine.protocol import Completion, Generation, Sampling
from asyncrl.transport.spec import JoinSpec, ReceiveReport

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class FakeEngine:
    def __init__(
        self,
        tokenizer: Any = None,
        policy: Callable[[list[int]], str] | None = None,
        seed: int | None = None,
        logprob: float = -0.5,
        vocab: int = 32,
        cached: Callable[[list[int]], int] = lambda ids: 0,
        routes: tuple[int, int] | None = None,
        expand: Callable[[list[int], list[bytes]], list[int]] | None = None,
    ):
        self.tok, self.policy, self.seed = tokenizer, policy, seed
        # a request with images: its prompt ids as the engine's processor expands them
        # (None: as given)
        self.expand = expand
        self.logprob, self.vocab, self.cached = logprob, vocab, cached
        # (layers, top_k): each completion carries routed experts, row p all p % 256 (a
        # recording engine: prompt and generated positions but the last)
        self.routes = routes
        self.version = 0
        self.timed_pause = False
        self.weights = "initial"
        self.requests: list[list[int]] = []  # each request's prompt ids
        self.samplings: list[Sampling] = []  # each request's sampling
        self.salts: list[str | None] = []
        self.images: list[list[bytes]] = []  # each request's images (PNG bytes)
        self.outputs: list[list[int]] = []  # each request's first sample's ids
        self.log: list[str] = []
        self.abort = False  # True: every request ends "abort" (a test's update under abort)
        self.receiver: Callable[[JoinSpec, bool], list[ReceiveReport]] | None = None
        self._running = asyncio.Event()
        self._running.set()
        self._epoch = 0  # bumped by an abort: requests of an older epoch end "abort"
        self._counter = 0
        self._shut = False

    @property
    def errored(self) -> bool:
        return self._shut

    def get_tokenizer(self) -> Any:
        return self.tok

    async def generate(
        self, prompt: str | list[int], sampling: Sampling, request_id: str,
        salt: str | None = None, images: Sequence[bytes] = (),
    ) -> Generation:  # fmt: skip
        self.images.append(list(images))
        if self._shut:
            raise RuntimeError("the engine is shut down")
        ids = list(self.tok.encode(prompt)) if isinstance(prompt, str) else list(prompt)
        self.requests.append(ids)
        if images and self.expand is not None:
            ids = self.expand(ids, list(images))
        self.samplings.append(sampling)
        self.salts.append(salt)
        self._counter += 1
        key = sampling.seed if sampling.seed is not None else f"unseeded-{self._counter}"
        samples = (self._sample(ids, sampling, key, i) for i in range(sampling.n))
        comps = list(await asyncio.gather(*samples))
        self.outputs.append(comps[0].token_ids.tolist())
        return Generation(ids, comps, self.cached(ids))

    async def _sample(self, ids: list[int], s: Sampling, key: Any, i: int) -> Completion:
        script = None
        if self.policy is not None:
            script = list(self.tok.encode(self.policy(ids), add_special_tokens=False))
            script.append(self.tok.eos_token_id)
        out, lps, vers, finish, epoch = [], [], [], "length", self._epoch
        while len(out) < s.max_tokens:
            await asyncio.sleep(0)
            await self._running.wait()
            if self._epoch != epoch or self.abort:
                finish = "abort"
                break
            if script is not None:
                out.append(script[len(out)])
                lps.append(self.logprob)
            else:
                h = hashlib.blake2b(repr((self.weights, key, ids, i, len(out))).encode()).digest()
                out.append(h[0] % self.vocab)
                lps.append(-5.0 * (h[1] + 1) / 257)
            vers.append(self.version)
            if script is not None and len(out) == len(script):
                finish = "stop"
                break
        if self.abort:
            finish = "abort"
        rec = None
        if self.routes is not None:
            n = len(ids) + len(out) - 1
            rec = np.broadcast_to((np.arange(n) % 256).astype(np.uint8)[:, None, None],
                                  (n, *self.routes)).copy()  # fmt: skip
        return Completion(
            i,
            np.asarray(out, dtype=np.int32),
            np.asarray(lps, dtype=np.float32) if s.logprobs else None,
            np.asarray(vers, dtype=np.int32),
            finish,
            ""
            if s.logprobs or self.tok is None
            else self.tok.decode(out, skip_special_tokens=True),
            rec,
        )

    async def pause(self, mode: str) -> None:
        self.log.append(f"pause:{mode}")
        self._running.clear()
        if mode == "abort":
            self._epoch += 1

    async def resume(self) -> None:
        self.log.append("resume")
        self._running.set()

    async def label(self, version: int) -> None:
        self.log.append(f"version:{version}")
        self.version = int(version)

    async def reset_prefix_cache(self, running: bool = False) -> None:
        self.log.append("reset")

    async def worker_clocks(self) -> list[float]:
        return [time.monotonic()]

    async def receive_weights(
        self, spec: JoinSpec, with_digests: bool, timeout_s: float
    ) -> list[ReceiveReport]:
        self.log.append(f"receive:{spec.key}")
        if self.receiver is not None:
            return self.receiver(spec, with_digests)
        return [ReceiveReport(ok=True, rank=spec.rank)]

    async def receive_weights_via_engine(
        self, spec: JoinSpec, version: int, with_digests: bool, timeout_s: float
    ) -> list[ReceiveReport]:
        self.log.append(f"receive_via_engine:{spec.key}:{version}")
        if self.receiver is not None:
            return self.receiver(spec, with_digests)
        return [ReceiveReport(ok=True, rank=spec.rank)]

    async def load_weights_file(self, path: str, timeout_s: float) -> None:
        self.log.append("load")
        with open(path, "rb") as f:
            self.weights = hashlib.sha256(f.read()).hexdigest()[:16]

    async def weight_states(self, timeout_s: float) -> list[dict[str, int]]:
        return [{"held": self.version, "loaded": self.version}]

    async def close_weight_groups(self, keys: list[str] | None, timeout_s: float) -> None:
        self.log.append(f"close:{keys}")

    async def call_workers(
        self, method: str, kwargs: dict[str, Any] | None, timeout_s: float
    ) -> list[Any]:
        raise NotImplementedError(f"FakeEngine has no workers to call {method}")

    def shutdown(self) -> None:
        self._shut = True
        self._running.set()
