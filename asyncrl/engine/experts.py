"""The experts a MoE engine's routers chose, per request and position (worker side of
``actor.record_experts``; the learner replays them: asyncrl/learner/routing.py).

    model forward (one engine step, requests' rows side by side)
      each MoE layer's router ─▶ capture(layer, topk_ids [rows, K]) ─▶ step buffer
                                 uint8 [T, layers, K] (T: the step's real tokens)
      the last MoE layer      ─▶ flush: rows of request j (query_start_loc[j:j+2]) are
                                 its positions positions[start..end), written into the
                                 request's record at those positions
    take(request_id, n)        ─▶ each sample's record, uint8 [positions, layers, K]

The router's own ``capture_fn`` (vLLM's hook for its routed-experts output, called with
the expert ids the kernel then uses) feeds the capture, so the record is what the engine
computed with, not a recomputation. Rows map to requests through what the V1 model
runner prepared for this step (``input_batch.req_ids``, ``query_start_loc``,
``positions``): a prompt split over steps (chunked prefill) or recomputed after a
preemption lands at its own positions. A prompt read from the prefix cache is never
computed and so has no record: recording needs ``enable_prefix_caching`` off (the
driver checks).

Layers are the model's MoE layers in order (a dense layer between them has none), as
the learner's ``routers()`` lists them. Records of requests nobody takes (aborted,
cancelled) are dropped oldest first beyond :data:`KEPT_RECORDS`.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import partial
from typing import Any

import numpy as np
import torch

# records held at once (live requests and finished ones not yet taken): far above
# max_num_seqs, so that only requests nobody will take fall off
KEPT_RECORDS = 4096
MAX_EXPERTS = 256  # expert ids travel as uint8 (Trajectory.routed_experts)
RANDOM_SUFFIX = 9  # vLLM's internal request id: "<request id>-<8 random characters>"


def sample_index(key: str, request_id: str, n: int) -> int | None:
    """Which sample of the request ``request_id`` (``n`` samples) vLLM's internal id
    ``key`` is: ``"<request id>-xxxxxxxx"`` for one sample, ``"<i>_<request id>-xxxxxxxx"``
    for sample i of several (vLLM's parallel sampling); the random suffix may be absent
    (``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``). None: another request's."""
    i = 0
    if n > 1:
        head, sep, key = key.partition("_")
        if not sep or not head.isdigit() or int(head) >= n:
            return None
        i = int(head)
    if key == request_id:
        return i
    if len(key) == len(request_id) + RANDOM_SUFFIX and key.startswith(request_id + "-"):
        return i
    return None


class RouteBook:
    """Every request's record, uint8 ``[positions, layers, top_k]``, filed step by step."""

    def __init__(self, layers: int, top_k: int):
        self.layers, self.top_k = layers, top_k
        self.records: OrderedDict[str, np.ndarray] = OrderedDict()  # id -> [capacity, L, K]
        self.lengths: dict[str, int] = {}

    def file(
        self, rows: np.ndarray, req_ids: list[str], starts: np.ndarray, positions: np.ndarray
    ) -> None:
        """One step's ``rows`` ``[T, layers, top_k]``: request ``req_ids[j]``'s are
        ``rows[starts[j]:starts[j+1]]``, at its positions from ``positions[starts[j]]`` on."""
        for j, rid in enumerate(req_ids):
            a, b = int(starts[j]), int(starts[j + 1])
            if a == b:
                continue
            first = int(positions[a])
            end = first + (b - a)
            rec = self.records.get(rid)
            if rec is None or len(rec) < end:
                grown = np.zeros((max(64, 2 * end), self.layers, self.top_k), dtype=np.uint8)
                if rec is not None:
                    grown[: len(rec)] = rec
                rec = self.records[rid] = grown
            rec[first:end] = rows[a:b]
            self.lengths[rid] = end  # a recompute (preemption) starts again at 0
            self.records.move_to_end(rid)
        while len(self.records) > KEPT_RECORDS:
            old, _ = self.records.popitem(last=False)
            self.lengths.pop(old, None)

    def take(self, request_id: str, n: int) -> list[np.ndarray | None]:
        """Each of the request's ``n`` samples' record (None: nothing recorded), removed
        from the book."""
        out: list[np.ndarray | None] = [None] * n
        for key in list(self.records):
            i = sample_index(key, request_id, n)
            if i is not None:
                rec = self.records.pop(key)
                out[i] = rec[: self.lengths.pop(key)].copy()
        return out


class ExpertRecorder:
    """Files every request's routed experts, from a vLLM V1 model runner's forwards,
    in a :class:`RouteBook` (``book``)."""

    def __init__(self, runner: Any):
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        if not isinstance(runner, GPUModelRunner):  # V2 lays out a step's rows otherwise
            raise ValueError(
                f"actor.record_experts: the engine runs {type(runner).__module__}."
                f"{type(runner).__name__}, not vLLM's V1 model runner whose step layout the "
                "recorder reads; set VLLM_USE_V2_MODEL_RUNNER=0"
            )
        self.runner = runner
        moe = [m for m in runner.get_model().modules() if isinstance(m, MoERunner)]
        if not moe:
            raise ValueError("actor.record_experts: the engine's model has no MoE layers")
        config = runner.model_config
        if config.get_num_experts() > MAX_EXPERTS:
            raise ValueError(
                f"actor.record_experts: {config.get_num_experts()} experts per layer do not "
                f"fit the record's uint8 (at most {MAX_EXPERTS})"
            )
        self.book = RouteBook(len(moe), int(config.get_num_experts_per_tok()))
        tokens = int(runner.scheduler_config.max_num_batched_tokens)
        self.step = torch.zeros(tokens, len(moe), self.book.top_k, dtype=torch.uint8)
        self.captured = 0  # MoE layers captured in the current forward
        self.moe = moe
        self.bind()

    def bind(self) -> None:
        """Hook every MoE layer's router (again after a reload: cheap, idempotent)."""
        order = {lid: i for i, lid in enumerate(sorted(m.layer_id for m in self.moe))}
        for m in self.moe:
            m.router.set_capture_fn(partial(self.capture, order[m.layer_id]))

    def capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        runner = self.runner
        n_reqs = runner.input_batch.num_reqs
        tokens = int(runner.query_start_loc.np[n_reqs]) if n_reqs else 0
        if not tokens or topk_ids.shape[0] < tokens:  # a dummy forward: no request's rows
            self.captured = 0
            return
        if layer == 0:  # a new forward (a failed one left its count behind)
            self.captured = 0
        self.step[:tokens, layer].copy_(topk_ids[:tokens])
        self.captured += 1
        if self.captured == self.book.layers:  # the step's last MoE layer
            self.captured = 0
            self.book.file(
                self.step[:tokens].numpy(),
                runner.input_batch.req_ids[:n_reqs],
                runner.query_start_loc.np[: n_reqs + 1],
                runner.positions[:tokens].numpy(),
            )
