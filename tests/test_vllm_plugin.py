"""asyncrl's vLLM plugin (asyncrl/engine/vllm_plugin.py): vLLM's shared-memory message
queue, a writer here and a reader in a spawned process as in an engine, delivers every
message with the plugin on, and a reader idling after its last message naps instead of
burning a core on sched_yield for vLLM's 1 s busy window."""

from __future__ import annotations

import multiprocessing as mp
import resource
import time

import pytest

from asyncrl.config import ConfigError
from asyncrl.engine import vllm_plugin
from asyncrl.engine.settings import EngineSettings

N_MESSAGES = 20


@pytest.mark.parametrize(
    "raw, nap", [("", 0.0), ("0.0002", 0.0002), ("abc", 0.0), ("1", 0.0), ("-1", 0.0)]
)
def test_nap_from_the_environment(monkeypatch, raw, nap):
    monkeypatch.setenv(vllm_plugin.ENV, raw)
    assert vllm_plugin.nap_seconds() == nap


def test_spin_nap_setting_checked():
    assert EngineSettings.defaults().spin_nap_s is None
    assert EngineSettings.defaults(spin_nap_s=0).spin_nap_s == 0
    with pytest.raises(ConfigError, match="actor.engine.spin_nap_s"):
        EngineSettings.defaults(spin_nap_s=0.5)
    with pytest.raises(ConfigError, match="actor.engine.spin_nap_s"):
        EngineSettings.defaults(spin_nap_s="fast")


def _reader(handle, nap: str, out) -> None:
    """A queue reader as vLLM's worker is one: the plugin loads first (from the
    environment), then the reader reads every message, then idles through the busy
    window; it reports its messages' delays and the CPU that idling cost."""
    import os

    os.environ[vllm_plugin.ENV] = nap
    vllm_plugin.register()
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    mq = MessageQueue.create_from_handle(handle, 0)
    mq.wait_until_ready()
    delays = []
    for _ in range(N_MESSAGES):
        sent = mq.dequeue(timeout=30)
        delays.append(time.time() - sent)
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    sent = mq.dequeue(timeout=30)  # the writer waits 1 s before this one
    last = time.time() - sent
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    idle_cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    out.put((vllm_plugin.nap_in_effect(), delays, idle_cpu, last))


def _run(*naps: str) -> list[tuple[float, list[float], float, float]]:
    """One reader per nap setting, all at once (each on its own queue, the same
    messages at the same times), so that they share whatever load the machine has."""
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    ctx = mp.get_context("spawn")
    queues = [MessageQueue(1, 1) for _ in naps]
    outs = [ctx.Queue() for _ in naps]
    procs = [
        ctx.Process(target=_reader, args=(mq.export_handle(), nap, out))
        for mq, nap, out in zip(queues, naps, outs, strict=True)
    ]
    for p in procs:
        p.start()
    try:
        for mq in queues:
            mq.wait_until_ready()
        for _ in range(N_MESSAGES):
            time.sleep(0.01)
            for mq in queues:
                mq.enqueue(time.time())
        time.sleep(1.0)  # vLLM's busy window: the readers spin (or nap) through it
        for mq in queues:
            mq.enqueue(time.time())
        return [out.get(timeout=60) for out in outs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


ATTEMPTS = 3  # of the side-by-side comparison, for a spinning reader that got a core


@pytest.mark.slow
def test_reader_naps_and_misses_nothing():
    """The napping reader and vLLM's spinning one side by side, through the same idle
    second under the same load. Every attempt's napping reader must meet its bounds; the
    spinning one is compared in the first attempt where it spun at all: on a machine
    whose cores are busy with other processes, a reader that yields can be left
    unscheduled through its whole busy window and use almost no CPU."""
    compared = []
    for _ in range(ATTEMPTS):
        (nap, delays, idle_cpu, last), (spin, _, spin_cpu, _) = _run("0.0002", "")
        assert nap == 0.0002 and spin == 0.0
        # a nap of 0.2 ms adds no latency of its own: the typical delay stays under 50
        # ms; the worst one and the message after the idle window are bounded looser,
        # since a loaded machine can leave the reader unscheduled for a tenth of a second
        assert len(delays) == N_MESSAGES and 0 <= min(delays)
        assert sorted(delays)[N_MESSAGES // 2] < 0.05 and max(delays) < 0.5, delays
        assert 0 <= last < 0.5, last
        # vLLM's own spin burns the whole second on a free core (1.0 s measured); the
        # nap loop ~0.12 s
        assert idle_cpu < 0.3, idle_cpu
        compared.append((spin_cpu, idle_cpu))
        if spin_cpu > idle_cpu:
            break
    assert any(spin_cpu > idle_cpu for spin_cpu, idle_cpu in compared), compared


def test_the_eager_rank_count_is_vllms_count_and_the_cpu_sampler_uses_it():
    """Each row's count of entries >= the sampled token's log-prob, as a sort gives it,
    with ties; on this CPU the plugin hands vLLM's sampler that count in place of its
    compiled one (whose first call compiles for seconds in every engine start)."""
    import torch
    from vllm.v1.sample import sampler

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 50, generator=g).log_softmax(-1)
    x[2, 7] = x[2, 3]  # a tie counts both
    ids = torch.tensor([[3], [0], [3], [49], [int(x[4].argmax())]])
    values = x.gather(-1, ids)
    expect = [sum(e >= v for e in row) for row, v in zip(x.tolist(), values.flatten().tolist())]
    assert vllm_plugin.count_at_least(x, values).tolist() == expect
    assert expect[4] == 1 and expect[2] >= 2
    vllm_plugin.register()
    assert sampler.batched_count_greater_than is vllm_plugin.count_at_least


def test_the_tp_embedding_masks_token_ids_eagerly_on_a_cpu():
    """A vocabulary-split embedding (tensor-parallel engines) masks its token ids with
    vLLM's own function, not its ``torch.compile``d wrapper (whose first call compiled
    for 4-8 s in every worker); the mask is the same."""
    import torch
    from vllm.model_executor.layers import vocab_parallel_embedding as embedding

    compiled = embedding.get_masked_input_and_mask
    vllm_plugin.register()
    eager = embedding.get_masked_input_and_mask
    assert eager is getattr(compiled, "__wrapped__", compiled)
    assert not hasattr(eager, "_torchdynamo_orig_callable")
    ids, mask = eager(torch.tensor([0, 5, 31, 32, 40, 63]), 32, 64, 0, 64, 64)
    assert ids.tolist() == [0, 0, 0, 0, 8, 31] and mask.tolist() == [True] * 3 + [False] * 3
