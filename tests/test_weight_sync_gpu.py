"""The transport endpoints on CUDA: what one GPU allows (NCCL groups of one, a
missing NCCL peer named within the timeout, CUDA shadows feeding a gloo group)
and, with two GPUs, a real two-rank NCCL sync. The in-process endpoint test also
runs on the CPU, so its logic is checked everywhere."""

from __future__ import annotations

import multiprocessing as mp
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from asyncrl.transport.broadcast import WeightSender
from asyncrl.transport.endpoint import ReceiverEndpoint, SenderEndpoint, digests
from asyncrl.transport.group import TransferError, make_group
from asyncrl.transport.spec import HEADER_BUCKET, NO_VERSION, JoinSpec

HOST = "127.0.0.1"
BUCKET_MB = 1 / 16
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def _model(device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    m = {f"l{i}.w": (torch.randn(64, 64, generator=g) * 0.02).bfloat16() for i in range(8)}
    m["norm"] = torch.ones(64)
    return {k: v.to(device) for k, v in m.items()}


def _step(model: dict[str, torch.Tensor], seed: int) -> None:
    """A handful of elements move (an lr-1e-6-like update), one tensor not at all."""
    g = torch.Generator().manual_seed(100 + seed)
    for k, v in model.items():
        if k.startswith("l") and k != "l0.w":
            idx = torch.randint(0, v.numel(), (20,), generator=g).to(v.device)
            v.view(-1)[idx] += 0.01


def _spec(port: int, backend: str = "gloo", timeout_s: float = 10.0, join_s: float = 30.0):
    return JoinSpec("g", HOST, port, 1, 2, timeout_s, join_s, backend, True)


def _no_load(tensors) -> None:
    """A loader that keeps nothing: the endpoint digests what it was handed."""


@pytest.mark.parametrize(
    "shadow_device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, cuda])]
)
def test_endpoints_in_process_gloo_with_shadows_on(shadow_device):
    """SenderEndpoint (shadows on ``shadow_device``) → gloo → ReceiverEndpoint (its
    blocking ``sync`` in a thread of this process)."""
    model = _model(shadow_device)
    ep = SenderEndpoint(HOST, "gloo", 10.0, 30.0, BUCKET_MB, shadow_device)
    rx = ReceiverEndpoint()
    pool = ThreadPoolExecutor(1)
    try:
        for version, mode in enumerate(["full", "sparse_delta", "changed_buckets"]):
            if version:
                _step(model, version)
            ep.snapshot(version, model.items(), retain=[version - 1] if version else [])

            got: list = []

            def go(port: int, got: list = got) -> None:
                got.append(pool.submit(rx.sync, _spec(port), _no_load, True))

            if version == 0:
                ep.open("g", 2, on_listening=go)
            else:
                go(ep.senders["g"].group.port)
            stats = ep.send("g", version, version - 1 if version else NO_VERSION, mode)
            report = got[0].result(timeout=60)
            assert report.ok and report.version == version, report
            assert report.digests == digests(model.items()), (version, mode)
            assert rx.loaded_digests()["digests"] == report.digests
            if mode == "sparse_delta":
                assert stats.buckets_sparse > 0 and stats.bytes_sent < stats.bytes_full
            if mode == "changed_buckets":
                assert stats.buckets_skipped > 0
    finally:
        pool.shutdown()
        rx.close_all()
        ep.close_all()


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=[pytest.mark.gpu, cuda])])
def test_group_of_one_runs_the_whole_send_path(backend):
    """World size 1 (all one GPU allows for NCCL): pack, plan, encode, broadcast."""
    group = make_group(HOST, 0, 0, 1, 10.0, backend=backend)
    device = "cuda" if backend == "nccl" else "cpu"
    assert group.backend == backend and group.device.type == device and group.port > 0
    sender = WeightSender(group, bucket_mb=BUCKET_MB)
    model = _model(device)
    s0 = sender.send(0, model.items(), mode="full")
    _step(model, 1)
    s1 = sender.send(1, model.items(), receiver_version=0, mode="sparse_delta")
    group.close()
    assert s0.bytes_sent >= s0.bytes_full and s0.mode == "full"
    assert s1.mode == "sparse_delta" and s1.buckets_sparse > 0 and s1.buckets_skipped > 0
    packed = sender.shadows.get(1)
    assert packed.buckets[0].device.type == device
    assert digests(packed.named_tensors()) == digests(model.items())


@pytest.mark.gpu
@cuda
def test_nccl_missing_receiver_is_named_within_the_timeout():
    timeout_s = 3.0
    group = None
    t0 = time.monotonic()
    with pytest.raises(TransferError) as info:
        # NCCL builds its communicator lazily: the group forms, the send's arrival
        # wait names the missing peer (an eager backend would fail in make_group).
        group = make_group(HOST, 0, 0, 2, timeout_s, backend="nccl")
        WeightSender(group, bucket_mb=BUCKET_MB).send(7, _model("cuda").items(), mode="full")
    elapsed = time.monotonic() - t0
    if group is not None:
        group.close()
        assert (info.value.bucket, info.value.version) == (HEADER_BUCKET, 7)
    assert info.value.peer_ranks == (1,)
    assert timeout_s - 0.1 <= elapsed < timeout_s + 5.0


def _nccl_receiver(port: int, out) -> None:
    torch.cuda.set_device(1)
    rx = ReceiverEndpoint()
    for _ in range(2):
        report = rx.sync(_spec(port, "nccl", 30.0, 60.0), _no_load, with_digests=True)
        out.put((report.ok, report.digests))
    rx.close_all()


@pytest.mark.gpu
@cuda
@two_gpus
def test_nccl_endpoints_across_two_gpus_are_bit_exact():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    torch.cuda.set_device(0)
    ep = SenderEndpoint(HOST, "nccl", 30.0, 60.0, BUCKET_MB)
    model = _model("cuda")
    procs = []

    def go(port: int) -> None:
        p = ctx.Process(target=_nccl_receiver, args=(port, out), daemon=True)
        p.start()
        procs.append(p)

    try:
        ep.snapshot(0, model.items())
        ep.open("g", 2, on_listening=go)
        ep.send("g", 0, NO_VERSION, "full")
        first = out.get(timeout=120)
        _step(model, 1)
        ep.snapshot(1, model.items(), retain=[0])
        s1 = ep.send("g", 1, 0, "sparse_delta")
        second = out.get(timeout=120)
    finally:
        ep.close_all()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert first[0] and second[0]
    assert s1.buckets_sparse > 0 and second[1] == digests(model.items())
