"""A fake of SGLang's offline Engine (``sglang.Engine``) at the library boundary, for
SGLangEngine's contract tests on a host where SGLang cannot run (docs/engines.md,
SGLang). :func:`installed` puts it in ``sys.modules`` as the ``sglang`` modules that
asyncrl/engine/sglang_engine.py imports.

Recorded from SGLang 0.5.23's source (the PyPI wheel; paths under python/sglang/srt/):
what SGLangEngine calls, with the names, fields and answers SGLang has there —

* ``Engine(**ServerArgs)`` (entrypoints/engine.py): ``server_args``,
  ``tokenizer_manager``, ``async_generate(input_ids, sampling_params, return_logprob,
  rid, cache_salt, ...)``, ``get_all_child_pids``, ``shutdown``. A batch answers one dict
  per request: ``output_ids`` (a matched stop token kept), ``text`` (stop token
  trimmed, special tokens skipped), ``meta_info`` with ``finish_reason``
  (``{"type": "stop", "matched": id}``, ``{"type": "length", "length": n}``, ``{"type":
  "abort", "message": ...}``), ``output_token_logprobs`` as ``(logprob, token id,
  None)``, ``weight_versions`` spans and ``weight_version``, ``cached_tokens``;
* the tokenizer manager (managers/tokenizer_manager.py, tokenizer_control_mixin.py):
  a request waits while ``is_pause`` and holds ``model_update_lock``'s reader side
  while it runs; ``pause_generation`` (``abort``: abort everything, then poll the lock
  every second until free; ``in_place`` / ``retract``: to the scheduler),
  ``continue_generation``, ``update_weight_version``, ``flush_cache``,
  ``begin_weight_update`` / ``update_weights_from_tensor`` / ``end_weight_update``
  (answers ``(success, message)``; a paused engine updates at once, else under the
  lock's writer side);
* the scheduler (managers/scheduler.py, scheduler_components/weight_updater.py): a
  paused scheduler runs no step (``retract`` moves the running requests to the waiting
  queue, their KV dropped); a tensor update outside a begin/end session fails; a flush
  fails while requests are running; a weight-version change records, per live request,
  how many tokens the old version made (utils/weight_versions.py);
* the sampler (layers/sampler.py): the returned log-prob is of the temperature-scaled
  distribution (``log(softmax(logits / T))``), taken before top-k/top-p; a request with
  ``sampling_seed`` samples from its own seeded generator;
* ``SamplingParams`` field names (sampling/sampling_params.py): any other key raises.

The model is real: transformers runs the model directory given as ``model_path``, one
token per request per scheduler turn (an asyncio task in the caller's loop, not a
process), so tokens and log-probs are the model's. Tensors are serialised with plain
pickle (SGLang's MultiprocessingSerializer shares them through torch's reductions).
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import sys
import types
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

# SamplingParams' API fields (sampling/sampling_params.py)
SAMPLING_FIELDS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
    "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "min_new_tokens", "n", "beam_width", "json_schema", "regex", "ebnf", "structural_tag",
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "watermark",
}  # fmt: skip
# the ServerArgs fields this fake reads or accepts (arg_groups/fields/*.py)
SERVER_FIELDS = {
    "model_path", "dtype", "context_length", "max_running_requests", "random_seed",
    "tp_size", "disable_cuda_graph", "disable_radix_cache", "log_level", "device",
    "mem_fraction_static", "max_total_tokens",
}  # fmt: skip
SAMPLING_EPS = 1e-6  # SamplingParams: a temperature below this is greedy (top_k = 1)


# ---- managers/io_struct.py: the inputs SGLangEngine sends -------------------------------
@dataclass(kw_only=True)
class PauseGenerationReqInput:
    mode: str = "abort"  # "abort" | "retract" | "in_place"


@dataclass(kw_only=True)
class ContinueGenerationReqInput:
    torch_empty_cache: bool = True


@dataclass(kw_only=True)
class BeginWeightUpdateReqInput:
    selector: str = "all"


@dataclass(kw_only=True)
class EndWeightUpdateReqInput:
    pass


@dataclass(kw_only=True)
class UpdateWeightsFromTensorReqInput:
    serialized_named_tensors: list[bytes]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: str = "all"
    torch_empty_cache: bool = False


@dataclass(kw_only=True)
class UpdateWeightVersionReqInput:
    new_version: str
    abort_all_requests: bool = True


@dataclass(kw_only=True)
class FlushCacheReqOutput:
    success: bool
    message: str = ""


class MultiprocessingSerializer:
    @staticmethod
    def serialize(obj: Any) -> bytes:
        return pickle.dumps(obj)

    @staticmethod
    def deserialize(data: bytes) -> Any:
        return pickle.loads(data)


# ---- the scheduler ----------------------------------------------------------------------
@dataclass
class Req:
    rid: str
    input_ids: list[int]
    params: dict[str, Any]
    return_logprob: bool
    generator: Any  # torch.Generator
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    events: list[tuple[str, int]] = field(default_factory=list)  # (old version, tokens)
    finish: dict[str, Any] | None = None
    spans: list[dict[str, Any]] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)


def version_spans(events: list[tuple[str, int]], current: str, n: int) -> list[dict[str, Any]]:
    """utils/weight_versions.py ``compute_weight_version_spans``, as meta_info shows it."""
    spans: list[dict[str, Any]] = []
    for version, end in [*events, (current, n)]:
        end = min(end, n)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans


class Scheduler:
    """One token per running request per turn, none while paused."""

    def __init__(self, model: Any, eos: int, seed: int | None):
        import torch

        self.model, self.eos = model, eos
        self.generator = torch.Generator().manual_seed(seed or 0)
        self.running: list[Req] = []
        self.paused: str | None = None  # "in_place" | "retract"
        self.retracted = False  # the running requests' KV was dropped (retract)
        self.weight_version = "default"
        self.session = False  # a weight-update session is open
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None

    def add(self, req: Req) -> None:
        if self.task is None:
            self.task = asyncio.ensure_future(self.loop())
        self.running.append(req)
        self.wake.set()

    async def loop(self) -> None:
        while True:
            await asyncio.sleep(0)
            if self.paused or not self.running:
                self.wake.clear()
                await self.wake.wait()
                continue
            for req in list(self.running):
                self.step(req)

    def step(self, req: Req) -> None:
        import torch

        p = req.params
        temperature, top_k, top_p = (
            p.get("temperature", 1.0),
            p.get("top_k", -1),
            p.get("top_p", 1.0),
        )
        if temperature < SAMPLING_EPS:
            temperature, top_k = 1.0, 1
        with torch.no_grad():
            logits = self.model(torch.tensor([req.input_ids + req.output_ids])).logits[0, -1]
        logits = logits.float() / temperature
        probs = torch.softmax(logits, -1)
        logprobs = torch.log(probs)  # SGLang returns these: before top-k/top-p
        weights = probs.clone()
        if top_k > 0:
            weights[weights < torch.topk(weights, min(top_k, len(weights))).values[-1]] = 0
        if top_p < 1:
            order = torch.argsort(weights, descending=True)
            cut = torch.cumsum(weights[order], 0) - weights[order] > top_p
            weights[order[cut]] = 0
        if len(req.output_ids) < p.get("min_new_tokens", 0):
            weights[self.eos] = 0
        tok = int(torch.multinomial(weights / weights.sum(), 1, generator=req.generator))
        req.output_ids.append(tok)
        req.logprobs.append(float(logprobs[tok]))
        if tok == self.eos and not p.get("ignore_eos", False):
            self.finish(req, {"type": "stop", "matched": tok})
        elif len(req.output_ids) >= p.get("max_new_tokens", 128):
            self.finish(req, {"type": "length", "length": p.get("max_new_tokens", 128)})

    def finish(self, req: Req, reason: dict[str, Any]) -> None:
        req.finish = reason
        req.spans = version_spans(req.events, self.weight_version, len(req.output_ids))
        self.running.remove(req)
        req.done.set()

    def abort_all(self) -> None:
        for req in list(self.running):
            self.finish(req, {"type": "abort", "message": "Abort all requests.",
                              "status_code": None, "err_type": None})  # fmt: skip

    def record_version(self, version: str) -> None:
        if version != self.weight_version:
            for req in self.running:
                if req.output_ids:
                    req.events.append((self.weight_version, len(req.output_ids)))
            self.weight_version = version

    def flush(self) -> bool:
        """Refused while requests are running (retracted ones wait without KV)."""
        return not self.running or (self.paused == "retract" and self.retracted)

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()


class RWLock:
    """managers/tokenizer_manager.py's ``model_update_lock``: requests read, updates write."""

    def __init__(self):
        self.readers, self.writer = 0, False
        self.cond = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def reader_lock(self) -> AsyncIterator[None]:
        async with self.cond:
            await self.cond.wait_for(lambda: not self.writer)
            self.readers += 1
        try:
            yield
        finally:
            async with self.cond:
                self.readers -= 1
                self.cond.notify_all()

    @contextlib.asynccontextmanager
    async def writer_lock(self) -> AsyncIterator[None]:
        async with self.cond:
            await self.cond.wait_for(lambda: not self.writer and not self.readers)
            self.writer = True
        try:
            yield
        finally:
            async with self.cond:
                self.writer = False
                self.cond.notify_all()

    async def is_locked(self) -> bool:
        return self.writer or self.readers > 0


class TokenizerManager:
    def __init__(self, tokenizer: Any, scheduler: Scheduler, tp_size: int):
        self.tokenizer, self.scheduler, self.tp_size = tokenizer, scheduler, tp_size
        self.is_pause = False
        self.is_pause_cond = asyncio.Condition()
        self.model_update_lock = RWLock()
        self.calls: list[str] = []  # every control call, in order

    async def generate_request(self, reqs: list[Req]) -> list[dict[str, Any]]:
        async with self.is_pause_cond:
            await self.is_pause_cond.wait_for(lambda: not self.is_pause)
        async with self.model_update_lock.reader_lock():
            for req in reqs:
                self.scheduler.add(req)
            await asyncio.gather(*(r.done.wait() for r in reqs))
        return [self.output(r) for r in reqs]

    def output(self, req: Req) -> dict[str, Any]:
        shown = (
            req.output_ids[:-1] if (req.finish or {}).get("matched") is not None else req.output_ids
        )
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finish,
            "prompt_tokens": len(req.input_ids),
            "weight_version": self.scheduler.weight_version,
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
        }
        if req.spans:
            meta["weight_versions"] = req.spans
            meta["weight_version"] = req.spans[-1]["version"]
        if req.return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [
                (lp, t, None) for lp, t in zip(req.logprobs, req.output_ids)
            ]
            meta["output_token_logprobs_length"] = len(req.output_ids)
        return {
            "text": self.tokenizer.decode(shown, skip_special_tokens=True),
            "output_ids": list(req.output_ids),
            "meta_info": meta,
        }

    async def pause_generation(self, obj: PauseGenerationReqInput) -> None:
        self.calls.append(f"pause:{obj.mode}")
        async with self.is_pause_cond:
            self.is_pause = True
            if obj.mode != "abort":
                self.scheduler.paused = obj.mode
                self.scheduler.retracted = obj.mode == "retract"
            else:
                while True:
                    self.scheduler.abort_all()
                    if not await self.model_update_lock.is_locked():
                        break
                    await asyncio.sleep(1.0)

    async def continue_generation(self, obj: ContinueGenerationReqInput) -> None:
        self.calls.append("continue")
        async with self.is_pause_cond:
            self.is_pause = False
            self.scheduler.paused, self.scheduler.retracted = None, False
            self.scheduler.wake.set()
            self.is_pause_cond.notify_all()

    async def update_weight_version(self, obj: UpdateWeightVersionReqInput) -> None:
        self.calls.append(f"version:{obj.new_version}")
        self.scheduler.record_version(obj.new_version)

    async def flush_cache(self, timeout_s: float | None = None) -> FlushCacheReqOutput:
        self.calls.append("flush")
        ok = self.scheduler.flush()
        return FlushCacheReqOutput(success=ok, message="" if ok else "requests are running")

    async def _session_call(self, fn: Any) -> tuple[bool, str]:
        async with self.is_pause_cond:
            paused = self.is_pause
            if paused:
                return fn()
        async with self.model_update_lock.writer_lock():
            return fn()

    async def begin_weight_update(self, obj: BeginWeightUpdateReqInput, request: Any = None):
        self.calls.append("begin")

        def begin() -> tuple[bool, str]:
            if self.scheduler.session:
                return False, "a weight-update session is already open"
            self.scheduler.session = True
            return True, "Success"

        return await self._session_call(begin)

    async def end_weight_update(self, obj: EndWeightUpdateReqInput, request: Any = None):
        self.calls.append("end")

        def end() -> tuple[bool, str]:
            if not self.scheduler.session:
                return False, "no weight-update session is open"
            self.scheduler.session = False
            return True, "Success"

        return await self._session_call(end)

    async def update_weights_from_tensor(
        self, obj: UpdateWeightsFromTensorReqInput, request: Any = None
    ) -> tuple[bool, str]:
        self.calls.append(f"update_weights_from_tensor:flush={obj.flush_cache}")
        if obj.abort_all_requests:
            self.scheduler.abort_all()
        return await self._session_call(lambda: self.load(obj))

    def load(self, obj: UpdateWeightsFromTensorReqInput) -> tuple[bool, str]:
        s = self.scheduler
        if not s.session:
            return False, "update_weights_from_tensor must run between begin and end"
        if len(obj.serialized_named_tensors) != self.tp_size:
            return False, "one serialized payload per tensor-parallel rank"
        named = MultiprocessingSerializer.deserialize(obj.serialized_named_tensors[0])
        params = dict(s.model.named_parameters())
        unknown = [n for n, _ in named if n not in params]
        if unknown:
            return False, f"unknown weights {unknown[:3]}"
        for name, tensor in named:
            params[name].data.copy_(tensor)
        if obj.weight_version is not None:
            s.record_version(obj.weight_version)
        if obj.flush_cache and not s.flush():
            return False, "Weights were updated, but the cache was not flushed"
        return True, "Success"


class Engine:
    """``sglang.Engine``: the model directory's model and tokenizer, in this process."""

    def __init__(self, **kwargs: Any):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        unknown = set(kwargs) - SERVER_FIELDS
        if unknown:
            raise TypeError(f"not a ServerArgs field this fake knows: {sorted(unknown)}")
        self.server_args = types.SimpleNamespace(**{"tp_size": 1, "random_seed": None, **kwargs})
        path = kwargs["model_path"]
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(path)
        scheduler = Scheduler(model, tok.eos_token_id, self.server_args.random_seed)
        self.tokenizer_manager = TokenizerManager(tok, scheduler, self.server_args.tp_size)

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        image_data: Any = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        *,
        cache_salt: str | list[str] | None = None,
    ) -> dict | list[dict]:
        import torch

        if stream or image_data is not None:
            raise NotImplementedError("the fake serves neither streams nor images")
        tok = self.tokenizer_manager.tokenizer
        if input_ids is None:
            texts = [prompt] if isinstance(prompt, str) else list(prompt or [])
            batch = [list(tok(t)["input_ids"]) for t in texts]
            single = isinstance(prompt, str)
        else:
            single = not input_ids or isinstance(input_ids[0], int)
            batch = [list(input_ids)] if single else [list(x) for x in input_ids]
        n = len(batch)
        params = (
            sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * n
        )
        logprob = return_logprob if isinstance(return_logprob, list) else [return_logprob] * n
        rids = rid if isinstance(rid, list) else [rid or f"fake-{id(batch)}-{i}" for i in range(n)]
        reqs = []
        for ids, p, lp, r in zip(batch, params, logprob, rids):
            unknown = set(p) - SAMPLING_FIELDS
            if unknown:
                raise TypeError(f"not a SamplingParams field: {sorted(unknown)}")
            seed = p.get("sampling_seed")
            gen = self.tokenizer_manager.scheduler.generator
            if seed is not None:
                gen = torch.Generator().manual_seed(seed % (1 << 63))
            reqs.append(Req(r, ids, p, bool(lp), gen))
        outs = await self.tokenizer_manager.generate_request(reqs)
        return outs[0] if single else outs

    def get_all_child_pids(self) -> list[int]:
        return []  # no processes of its own

    def shutdown(self) -> None:
        self.tokenizer_manager.scheduler.stop()


@contextlib.contextmanager
def installed() -> Iterator[types.ModuleType]:
    """This fake as ``sglang``, ``sglang.srt.managers.io_struct`` and ``sglang.srt.utils``
    in ``sys.modules`` for the duration (whatever was there before comes back)."""
    names = ["sglang", "sglang.srt", "sglang.srt.managers", "sglang.srt.managers.io_struct",
             "sglang.srt.utils"]  # fmt: skip
    mods = {n: types.ModuleType(n) for n in names}
    mods["sglang"].Engine = Engine
    io_struct = mods["sglang.srt.managers.io_struct"]
    for cls in (PauseGenerationReqInput, ContinueGenerationReqInput, BeginWeightUpdateReqInput,
                EndWeightUpdateReqInput, UpdateWeightsFromTensorReqInput,
                UpdateWeightVersionReqInput):  # fmt: skip
        setattr(io_struct, cls.__name__, cls)
    mods["sglang.srt.utils"].MultiprocessingSerializer = MultiprocessingSerializer
    before = {n: sys.modules.get(n) for n in names}
    sys.modules.update(mods)
    try:
        yield mods["sglang"]
    finally:
        for n, m in before.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
