"""asyncrl's vLLM general plugin: vLLM loads it in every process of an engine (the
front end, the engine core, each worker) through the ``vllm.general_plugins`` entry
point in pyproject.toml.

What it does: make the waits of vLLM's shared-memory message queues sleep instead of
spin. A reader (the engine core waiting for its worker's answer, the worker waiting
for the next step) spins on ``sched_yield`` for 1 s after its last message before it
sleeps on the queue's ZeroMQ notification. On a GPU box that buys latency with cores
nobody else needs. On a CPU those loops run through every gap between model steps and
take the core the learner trains on: measured on the default job (2 cores,
docs/speed.md), 49% of the engine core's CPU and a third of the worker's, about 0.37 of
a core in all. Here each turn of that loop naps instead (``ASYNCRL_VLLM_NAP_S``, e.g.
0.0002 s): the control flow is vLLM's, a message waits at most one nap longer.

(Dropping the spin altogether, so that every wait sleeps on the notification, stalled
the engine: the first weight sync waited out vLLM's 5 s re-check over and over.)

It also registers asyncrl's transport as a vLLM weight-transfer backend
(:func:`register_transfer_engine`, asyncrl/engine/vllm_transfer.py), which an engine
uses only when started with that backend (``broker.engine_api=vllm``).

The environment carries the setting, so the engine's spawned processes inherit it;
the actor sets it from ``actor.engine.spin_nap_s``. Unset or 0: vLLM's own spin. A
vLLM without the class this wraps: nothing happens.

On a CPU it also gives the sampler an eager count of each sampled token's rank
(:func:`count_at_least`, the same sum vLLM writes). vLLM's is ``torch.compile``d with
Inductor, and the first step that returns log-probs compiles it: 4-10 s of one core
on this 2-core machine, in every engine start, while the engine answers nothing else
(the broker's first question to the actor waited that long). For the same reason a
tensor-parallel engine's vocabulary-split embedding masks its token ids eagerly
(:func:`eager_vocab_mask`): vLLM compiles that mask too, and the first step of every
worker waited 4-8 s for it (measured on the tiny model, 2 cores).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from asyncrl.engine.settings import TRANSFER_BACKEND

if TYPE_CHECKING:
    import torch

ENV = "ASYNCRL_VLLM_NAP_S"


def nap_seconds() -> float:
    """This process's nap per turn of a queue's wait loop (0: vLLM's own spin)."""
    raw = os.environ.get(ENV, "").strip()
    try:
        value = float(raw) if raw else 0.0
    except ValueError:
        return 0.0
    return value if 0.0 < value <= 0.01 else 0.0


def count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row of ``x`` (batch, vocab): how many entries are >= that row's ``values``
    (batch, 1), i.e. the sampled token's rank; vLLM's ``batched_count_greater_than``
    without the compile."""
    return (x >= values).sum(-1)


def register() -> None:
    """vLLM's plugin hook (called once per process, before any engine part is built)."""
    eager_rank_count()
    eager_vocab_mask()
    register_transfer_engine()
    nap = nap_seconds()
    if not nap:
        return
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:  # another vLLM: leave it alone
        return
    if getattr(SpinCondition.wait, "_asyncrl", 0.0):
        return
    original = SpinCondition.wait

    def wait(self, timeout_ms: int | None = None) -> None:
        # vLLM's busy branch (a read less than busy_loop_s ago) is one sched_yield
        if self.is_reader and time.monotonic() <= self.last_read + self.busy_loop_s:
            time.sleep(nap)
            return
        original(self, timeout_ms)

    wait._asyncrl = nap  # type: ignore[attr-defined]
    SpinCondition.wait = wait


def register_transfer_engine() -> None:
    """asyncrl's transport as a vLLM weight-transfer backend, named ``TRANSFER_BACKEND``
    (asyncrl/engine/vllm_transfer.py, imported when an engine asks for it). A vLLM
    without that factory: nothing happens."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return
    try:
        WeightTransferEngineFactory.register_engine(
            TRANSFER_BACKEND, "asyncrl.engine.vllm_transfer", "GlooTransferEngine"
        )
    except ValueError:  # registered already in this process
        pass


def eager_rank_count() -> None:
    """On a CPU, the sampler's rank count without ``torch.compile`` (see the module's
    docstring). A vLLM without that function: nothing happens."""
    try:
        from vllm.platforms import current_platform
        from vllm.v1.sample import sampler
    except ImportError:
        return
    if current_platform.is_cpu() and hasattr(sampler, "batched_count_greater_than"):
        sampler.batched_count_greater_than = count_at_least


def eager_vocab_mask() -> None:
    """On a CPU, ``VocabParallelEmbedding``'s token-id mask (used only with tensor
    parallelism) without ``torch.compile``: vLLM's own function, undecorated. A vLLM
    without it: nothing happens."""
    try:
        from vllm.model_executor.layers import vocab_parallel_embedding as embedding
        from vllm.platforms import current_platform
    except ImportError:
        return
    compiled = getattr(embedding, "get_masked_input_and_mask", None)
    eager = getattr(compiled, "__wrapped__", None)
    if current_platform.is_cpu() and eager is not None:
        embedding.get_masked_input_and_mask = eager


def nap_in_effect() -> float:
    """The nap this process's vLLM queues use (0: vLLM's own spin): what the plugin
    did here, for tests and the worker's ``asyncrl_spin_nap``."""
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        return 0.0
    return float(getattr(SpinCondition.wait, "_asyncrl", 0.0))
