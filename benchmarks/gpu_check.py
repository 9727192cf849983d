"""GPU check of the weight transport (no vLLM, no Ray): what one GPU allows.

    1. environment: torch, CUDA, GPUs, NCCL
    2. buckets + sparse delta on CUDA: pack, one AdamW step (lr 1e-6, bf16), plan,
       encode, apply: bit-exact, GB/s against a CUDA copy of the same bytes
    3. an NCCL group of one: the whole send path (header, dense, sparse) on CUDA
    4. an NCCL peer that never arrives: named within the timeout, no hang
    5. CUDA shadows feeding a gloo group (the learner on GPU, a CPU receiver)
    6. two GPUs only: a real two-rank NCCL sync, bit-exact, GB/s (else: skipped)

Prints one line per check, a summary table and, last, one JSON line. Exit status
1 if any check failed. Run from the repository root: ``python benchmarks/gpu_check.py``.
``--dry-run-on-cpu`` runs the same checks with cpu/gloo in place of cuda/nccl (a
small model), to catch mistakes before spending GPU time.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root goes on sys.path
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import json  # noqa: E402
import multiprocessing as mp  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

HOST = "127.0.0.1"
DRY = "--dry-run-on-cpu" in sys.argv
DEV, NCCL = ("cpu", "gloo") if DRY else ("cuda", "nccl")
PARAMS = 4_000_000 if DRY else 100_000_000  # 200 MB of bf16 on the GPU: enough for GB/s
BUCKET_MB = 64.0
RESULTS: list[tuple[str, str, str]] = []  # (check, PASS | FAIL | SKIP, detail)
FIGURES: dict[str, Any] = {}


def check(name: str) -> Callable:
    def wrap(fn: Callable) -> Callable:
        def run(*args: Any) -> None:
            t0 = time.perf_counter()
            try:
                detail = fn(*args) or ""
                status = "SKIP" if detail.startswith("skipped") else "PASS"
            except Exception as e:  # noqa: BLE001 - every check reports, the next one runs
                traceback.print_exc()
                status, detail = "FAIL", f"{type(e).__name__}: {e}"
            dt = time.perf_counter() - t0
            RESULTS.append((name, status, f"{detail} ({dt:.1f}s)"))
            print(f"[{status}] {name}: {detail} ({dt:.1f}s)", flush=True)

        return run

    return wrap


def model(params: int, device: str) -> list[tuple[str, torch.Tensor]]:
    d = 1024
    g = torch.Generator(device=device).manual_seed(0)
    out, n, i = [], 0, 0
    while n < params:
        t = torch.randn((4 * d, d), generator=g, device=device, dtype=torch.bfloat16) * 0.02
        out += [(f"l{i}.w", t), (f"l{i}.norm", torch.ones(d, device=device, dtype=torch.bfloat16))]
        n += t.numel() + d
        i += 1
    return out


def adamw_step(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    params = [torch.nn.Parameter(t.clone()) for _, t in named]
    opt = torch.optim.AdamW(params, lr=1e-6)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    return [(n, p.detach()) for (n, _), p in zip(named, params, strict=True)]


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e9


def cuda_sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- checks ------------------------------------------------------------------------------------
@check("environment")
def env() -> str:
    import torch.distributed as dist

    n = torch.cuda.device_count()
    FIGURES.update(torch=torch.__version__, cuda=torch.version.cuda, gpus=n)
    if not torch.cuda.is_available() and not DRY:
        raise RuntimeError("CUDA is not available")
    has_nccl = torch.cuda.is_available() and dist.is_nccl_available()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if has_nccl else "none"
    FIGURES["nccl"] = nccl
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(n))
    return f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, {n} GPU(s): {names}"


def _delta_pass(new_buckets: list, old_buckets: list, verify: bool) -> tuple[float, int]:
    """Seconds to plan, encode and apply every bucket's delta onto a copy of the old one
    (the copy is made, and the result checked bit-exact, outside the timed part), and
    the bytes the plans would send."""
    from asyncrl.transport.delta import Kind, Mode, apply_sparse, encode_sparse, plan_bucket

    held = [old.clone() for old in old_buckets]
    cuda_sync()
    t0 = time.perf_counter()
    sent = 0
    for new, old, h in zip(new_buckets, old_buckets, held, strict=True):
        plan = plan_bucket(Mode.SPARSE, new, old)
        sent += plan.nbytes
        if plan.kind is Kind.SPARSE:
            apply_sparse(h, encode_sparse(new, old), plan.nnz)
        elif plan.kind is Kind.DENSE:
            h.copy_(new)
    cuda_sync()
    seconds = time.perf_counter() - t0
    if verify and not all(
        torch.equal(h.view(torch.uint8), new.view(torch.uint8))
        for h, new in zip(held, new_buckets, strict=True)
    ):
        raise AssertionError("sparse delta on CUDA is not bit-exact")
    return seconds, sent


@check("buckets + sparse delta on CUDA")
def delta_on_cuda() -> str:
    from asyncrl.transport.buckets import pack

    v0 = model(PARAMS, DEV)
    v1 = adamw_step(v0)
    cuda_sync()
    t0 = time.perf_counter()
    p0 = pack(v0, BUCKET_MB, DEV)
    cuda_sync()
    t_pack = time.perf_counter() - t0
    p1 = pack(v1, BUCKET_MB, DEV)
    nbytes = p0.manifest.nbytes
    flat = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    src = torch.empty_like(flat)
    cuda_sync()
    t0 = time.perf_counter()
    flat.copy_(src)
    cuda_sync()
    t_copy = time.perf_counter() - t0
    # Timed twice: the first pass pays CUDA's lazy kernel loading, the second is steady state.
    (t_cold, sent), (t_warm, _) = (_delta_pass(p1.buckets, p0.buckets, i == 0) for i in range(2))
    FIGURES.update(
        cuda_pack_gbps=gbps(nbytes, t_pack),
        cuda_memcpy_gbps=gbps(nbytes, t_copy),
        cuda_delta_gbps=gbps(nbytes, t_warm),
        cuda_delta_cold_gbps=gbps(nbytes, t_cold),
        sparse_frac=sent / nbytes,
    )
    return (
        f"{nbytes / 1e6:.0f} MB: pack {gbps(nbytes, t_pack):.0f} GB/s, delta plan+encode+apply "
        f"{gbps(nbytes, t_warm):.0f} GB/s (first pass {gbps(nbytes, t_cold):.1f}), "
        f"memcpy {gbps(nbytes, t_copy):.0f} GB/s; "
        f"sparse sends {sent / nbytes:.3f} of full, bit-exact"
    )


@check("NCCL group of one: full + sparse send on CUDA")
def nccl_one() -> str:
    from asyncrl.transport.broadcast import WeightSender
    from asyncrl.transport.endpoint import digests
    from asyncrl.transport.group import make_group

    group = make_group(HOST, 0, 0, 1, 30.0, backend=NCCL)
    try:
        sender = WeightSender(group, bucket_mb=BUCKET_MB)
        v0 = model(PARAMS // 4, DEV)
        s0 = sender.send(0, v0, mode="full")  # pays NCCL's lazy communicator set-up
        warm = sender.send(0, v0, mode="full")
        v1 = adamw_step(v0)
        s1 = sender.send(1, v1, receiver_version=0, mode="sparse_delta")
        if digests(sender.shadows.get(1).named_tensors()) != digests(v1):
            raise AssertionError("shadow of version 1 differs from the model")
    finally:
        group.close()
    if s1.mode != "sparse_delta" or s1.buckets_sparse == 0:
        raise AssertionError(f"no sparse bucket: {s1}")
    FIGURES["nccl_one_full_seconds"] = [round(s0.seconds, 4), round(warm.seconds, 4)]
    return (
        f"full {s0.bytes_sent / 1e6:.0f} MB in {s0.seconds:.3f}s (again: {warm.seconds:.4f}s, "
        f"pack {warm.pack_seconds:.4f}s); sparse {s1.bytes_sent / 1e6:.1f} MB "
        f"({s1.buckets_sparse}/{s1.buckets_total} buckets sparse)"
    )


@check("NCCL peer that never arrives: named within the timeout")
def nccl_timeout() -> str:
    from asyncrl.transport.broadcast import WeightSender
    from asyncrl.transport.group import TransferError, make_group
    from asyncrl.transport.spec import HEADER_BUCKET

    timeout_s = 3.0
    group = None
    t0 = time.monotonic()
    try:
        # NCCL builds its communicator lazily, so the group forms and the send's
        # arrival wait names the peer; a backend that joins eagerly fails in make_group.
        group = make_group(HOST, 0, 0, 2, timeout_s, backend=NCCL)
        WeightSender(group).send(5, [("w", torch.ones(8, device=DEV))], mode="full")
    except TransferError as e:
        dt = time.monotonic() - t0
        if e.peer_ranks != (1,) or (
            group is not None and (e.bucket, e.version) != (HEADER_BUCKET, 5)
        ):
            raise AssertionError(f"wrong culprit: {e}") from e
        if dt > timeout_s + 5:
            raise AssertionError(f"took {dt:.1f}s for a {timeout_s}s timeout") from e
        return f"TransferError after {dt:.1f}s: {e}"
    finally:
        if group is not None:
            group.close()
    raise AssertionError("the send did not fail")


@check("CUDA shadows -> gloo -> CPU receiver (endpoints)")
def gloo_from_cuda() -> str:
    from concurrent.futures import ThreadPoolExecutor

    from asyncrl.transport.endpoint import ReceiverEndpoint, SenderEndpoint, digests
    from asyncrl.transport.spec import NO_VERSION, JoinSpec

    ep = SenderEndpoint(HOST, "gloo", 60.0, 60.0, BUCKET_MB, DEV)
    rx = ReceiverEndpoint()
    pool = ThreadPoolExecutor(1)  # the receiver's blocking sync, beside the sender
    v0 = model(PARAMS // 4, DEV)
    out = []
    try:
        for version, (mode, named) in enumerate([("full", v0), ("sparse_delta", adamw_step(v0))]):
            ep.snapshot(version, named, retain=[0])

            got: list = []

            def go(port: int, got: list = got) -> None:
                spec = JoinSpec("g", HOST, port, 1, 2, 60.0, 60.0, "gloo", True)
                got.append(pool.submit(rx.sync, spec, lambda tensors: None, True))

            if version == 0:
                ep.open("g", 2, on_listening=go)
            else:
                go(ep.senders["g"].group.port)
            s = ep.send("g", version, NO_VERSION if version == 0 else 0, mode)
            report = got[0].result(timeout=180)
            if not report.ok:
                raise AssertionError(report.error)
            if report.digests != digests(named):
                raise AssertionError(f"version {version} ({mode}) not bit-exact")
            out.append(s)
    finally:
        pool.shutdown()
        rx.close_all()
        ep.close_all()
    FIGURES["gloo_from_cuda_gbps"] = out[0].gbps
    return f"full {out[0].gbps:.2f} GB/s, sparse {out[1].bytes_sent / 1e6:.1f} MB, bit-exact"


def _rank1(port: int, q: Any) -> None:
    from asyncrl.transport.endpoint import ReceiverEndpoint
    from asyncrl.transport.spec import JoinSpec

    torch.cuda.set_device(1)
    rx = ReceiverEndpoint()
    for _ in range(2):
        spec = JoinSpec("g", HOST, port, 1, 2, 60.0, 120.0, "nccl", True)
        report = rx.sync(spec, lambda tensors: None, with_digests=True)
        q.put((report.ok, report.digests))
    rx.close_all()


@check("two-rank NCCL sync across two GPUs")
def nccl_two() -> str:
    if torch.cuda.device_count() < 2:
        return (
            f"skipped: {torch.cuda.device_count()} GPU(s) visible; two NCCL ranks cannot share one"
        )
    from asyncrl.transport.endpoint import SenderEndpoint, digests
    from asyncrl.transport.spec import NO_VERSION

    ctx = mp.get_context("spawn")
    q, procs = ctx.Queue(), []
    torch.cuda.set_device(0)
    ep = SenderEndpoint(HOST, "nccl", 60.0, 120.0, BUCKET_MB)
    v0 = model(PARAMS, "cuda")
    v1 = adamw_step(v0)

    def go(port: int) -> None:
        procs.append(ctx.Process(target=_rank1, args=(port, q), daemon=True))
        procs[-1].start()

    try:
        ep.snapshot(0, v0)
        ep.open("g", 2, on_listening=go)
        s0 = ep.send("g", 0, NO_VERSION, "full")
        r0 = q.get(timeout=180)
        ep.snapshot(1, v1, retain=[0])
        s1 = ep.send("g", 1, 0, "sparse_delta")
        r1 = q.get(timeout=180)
    finally:
        ep.close_all()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if r0[1] != digests(v0) or r1[1] != digests(v1):
        raise AssertionError("two-rank NCCL sync not bit-exact")
    FIGURES["nccl_2gpu_gbps"] = s0.gbps
    return f"full {s0.gbps:.1f} GB/s, sparse {s1.bytes_sent / 1e6:.1f} MB, bit-exact"


def main() -> int:
    env()
    if torch.cuda.is_available() or DRY:
        delta_on_cuda()
        nccl_one()
        nccl_timeout()
        gloo_from_cuda()
        nccl_two()
    print("\nGPU check summary")
    for name, status, detail in RESULTS:
        print(f"  {status:4}  {name}: {detail}")
    FIGURES["checks"] = {name: status for name, status, _ in RESULTS}
    FIGURES["ok"] = all(s != "FAIL" for _, s, _ in RESULTS)
    print(json.dumps(FIGURES), flush=True)
    return 0 if FIGURES["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
