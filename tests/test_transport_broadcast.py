"""Real gloo groups on 127.0.0.1: modes stay bit-exact, failures name the peer and never hang.

Receivers run in 'spawn' processes where a process matters (bit-exactness across
processes, a receiver killed mid-sync); a receiver that merely never calls
``receive`` is a thread, which saves a torch import on a small CI box.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from asyncrl.transport.broadcast import WeightSender
from asyncrl.transport.buckets import pack
from asyncrl.transport.group import HEARTBEAT_S, Heartbeat, TransferError, free_port, make_group
from asyncrl.transport.receiver import WeightReceiver
from asyncrl.transport.spec import HEADER_BUCKET, NO_VERSION
from asyncrl.transport.wire import HEADER_MAGIC, decode_header, encode_header, header_key

HOST = "127.0.0.1"
BUCKET_MB = 16 / 1024  # 16 KiB buckets: a small model still spans many buckets
JOIN_S = 60.0  # spawned children import torch: generous on a loaded 2-core box
SLACK_S = 3.0  # heartbeat silence window + scheduling noise


# ----------------------------------------------------------------- the model
def _make_model(seed: int = 0) -> torch.nn.ModuleDict:
    """bf16 linears (the first two frozen), fp32 norms, an int64 buffer."""
    torch.manual_seed(seed)
    m = torch.nn.ModuleDict()
    m["embed"] = torch.nn.Embedding(256, 32)
    for i in range(4):
        m[f"l{i}_q"] = torch.nn.Linear(32, 32, bias=False)
        m[f"l{i}_mlp"] = torch.nn.Linear(32, 128)
        m[f"l{i}_norm"] = torch.nn.LayerNorm(32)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else None
    for name, mod in m.items():
        if "norm" not in name:
            mod.to(torch.bfloat16)
    for name in ("embed", "l0_q", "l0_mlp", "l0_norm"):
        m[name].requires_grad_(False)
    m.register_buffer("positions", torch.arange(64, dtype=torch.int64))
    return m


def _adamw_step(model: torch.nn.ModuleDict, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (8,), generator=g)
    h = model["embed"](x)
    for i in range(4):
        h = model[f"l{i}_norm"](h.float()).bfloat16()
        h = h + model[f"l{i}_q"](h)
        h = h + model[f"l{i}_mlp"](h)[:, :32]
    loss = h.float().pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _export(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Layer-by-layer stream, as the learner exports it."""
    yield from model.state_dict().items()


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _expected_counts(new: dict, base: dict | None, mode: str) -> tuple[int, int, int]:
    """(skipped, sparse, dense) from first principles, entry by entry."""
    manifest = pack(new.items(), bucket_mb=BUCKET_MB).manifest
    skipped = sparse = dense = 0
    for spec in manifest.buckets:
        if base is None or mode == "full":
            dense += 1
            continue
        changed = 0
        for e in spec.entries:
            a, b = new[e.name].reshape(-1), base[e.name].reshape(-1)
            changed += int(
                (
                    a.view(torch.uint8).view(-1, a.element_size())
                    != b.view(torch.uint8).view(-1, b.element_size())
                )
                .any(1)
                .sum()
            )
        if changed == 0:
            skipped += 1
        elif mode == "sparse_delta" and changed * (4 + spec.dtype.itemsize) < spec.nbytes:
            sparse += 1
        else:
            dense += 1
    return skipped, sparse, dense


# ----------------------------------------------------------------- children
def _receiver_main(
    port: int, rank: int, world: int, n_syncs: int, timeout_s: float, die_at: int, out
) -> None:
    """Receive ``n_syncs`` syncs, shipping every tensor's bytes home (``die_at`` < 0), or
    SIGKILL ourselves when posting payload receive ``die_at`` of the second sync."""
    torch.set_num_threads(1)
    group = make_group(HOST, port, rank, world, timeout_s, backend="gloo", join_timeout_s=JOIN_S)
    receiver = _DyingReceiver(group, die_at) if die_at >= 0 else WeightReceiver(group)
    for _ in range(n_syncs):
        try:
            version, tensors = receiver.receive()
        except TransferError as e:
            out.put(("error", (e.peer_ranks, e.bucket, e.version, str(e))))
            return
        # A process about to die ships nothing big: a SIGKILL mid-write would wedge the pipe.
        ship = die_at < 0
        data = (
            {n: t.reshape(-1).view(torch.uint8).numpy().tobytes() for n, t in tensors}
            if ship
            else {}
        )
        out.put((version, (data, receiver.last_stats.bytes_received)))


class _DyingReceiver(WeightReceiver):
    def __init__(self, group, die_at: int):
        super().__init__(group)
        self._die_at, self._calls = die_at, 0

    def _bcast(self, buf):
        if self._seq == 2:
            self._calls += 1
            if self._calls == 2 + self._die_at:  # +2: the two header broadcasts
                os.kill(os.getpid(), signal.SIGKILL)
        return super()._bcast(buf)


def _spawn(world: int, n_syncs: int, timeout_s: float, die_at: dict[int, int] | None = None):
    """Receivers 1..world-1, each with its own result queue (a child killed mid-write
    must not take the others' channel down with it)."""
    ctx = mp.get_context("spawn")
    port = free_port(HOST)
    outs = {r: ctx.Queue() for r in range(1, world)}
    procs = [
        ctx.Process(
            target=_receiver_main,
            args=(port, r, world, n_syncs, timeout_s, (die_at or {}).get(r, -1), outs[r]),
            daemon=True,
        )
        for r in range(1, world)
    ]
    for p in procs:
        p.start()
    return port, outs, procs


def _reap(procs) -> None:
    for p in procs:
        p.join(timeout=JOIN_S)
        if p.is_alive():  # only our own children, by handle
            p.kill()
            p.join()


# ----------------------------------------------------------------- tests
def test_every_mode_is_bit_exact_across_versions_and_skips():
    """Two receiver processes follow versions 0..6 (missing 3) through every mode."""
    world, timeout_s = 3, 30.0
    # (version, mode sent, receiver version); version 3 is produced but never sent.
    schedule = [(0, "sparse_delta", NO_VERSION), (1, "changed_buckets", 0), (2, "sparse_delta", 1),
                (4, "sparse_delta", 2), (5, "sparse_delta", 4), (6, "full", 5)]  # fmt: skip
    port, outs, procs = _spawn(world, len(schedule), timeout_s)
    try:
        model = _make_model()
        opt = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=1e-6, weight_decay=0.01
        )
        sender = WeightSender(
            make_group(HOST, port, 0, world, timeout_s, backend="gloo", join_timeout_s=JOIN_S),
            bucket_mb=BUCKET_MB,
        )
        snaps = {0: _snapshot(model)}
        stats = {}
        for version, mode, held in schedule:
            while max(snaps) < version:  # one optimizer step per version; 3 is never published
                _adamw_step(model, opt, seed=max(snaps))
                if max(snaps) == 4:  # version 5 moves one matrix a lot: its bucket must go dense
                    with torch.no_grad():
                        model["l2_mlp"].weight.add_(1.0)
                snaps[max(snaps) + 1] = _snapshot(model)
            stats[version] = sender.send(version, _export(model), receiver_version=held, mode=mode)
        got = {}
        for rank, out in outs.items():
            for _ in schedule:
                version, payload = out.get(timeout=JOIN_S)
                assert version != "error", payload
                got[(rank, version)] = payload
    finally:
        _reap(procs)

    for version, mode, held in schedule:
        s = stats[version]
        base = snaps.get(held)
        used = "full" if base is None else mode
        assert s.mode == used and s.base_version == held
        assert (s.buckets_skipped, s.buckets_sparse, s.buckets_dense) == _expected_counts(
            snaps[version], base, used
        )
        for rank in range(1, world):
            tensors, nbytes = got[(rank, version)]
            assert set(tensors) == set(snaps[version])
            for name, ref in snaps[version].items():
                t = torch.frombuffer(bytearray(tensors[name]), dtype=torch.uint8)
                assert torch.equal(t, ref.reshape(-1).view(torch.uint8)), (rank, version, name)
            assert nbytes == s.bytes_sent - s.header_bytes
    # The partial modes did their job on this AdamW lr=1e-6 bf16 run.
    # Frozen embedding + int64 buffer buckets at least; fp32 norms move every step.
    assert stats[1].buckets_skipped >= 2 and stats[1].bytes_sent < stats[1].bytes_full
    assert stats[2].buckets_sparse >= 1 and stats[2].bytes_sent < stats[1].bytes_sent
    assert stats[4].buckets_sparse >= 1  # delta against version 2, across the missed version 3
    assert stats[5].buckets_dense >= 1 and stats[5].buckets_sparse >= 1  # l2_mlp went dense
    assert stats[6].bytes_sent >= stats[6].bytes_full


def test_killed_receiver_is_named_within_the_timeout():
    """Rank 1 SIGKILLs itself mid-sync; the sender (and rank 2) raise naming it."""
    world, timeout_s = 3, 3.0
    port, outs, procs = _spawn(world, 2, timeout_s, die_at={1: 3})
    try:
        sender = WeightSender(
            make_group(HOST, port, 0, world, timeout_s, backend="gloo", join_timeout_s=JOIN_S),
            bucket_mb=BUCKET_MB,
        )
        model = {f"w{i}": torch.randn(8192) for i in range(16)}  # 32 KiB each: 16 buckets
        sender.send(0, model.items(), mode="full")
        t0 = time.monotonic()
        with pytest.raises(TransferError) as info:
            sender.send(1, model.items(), mode="full")
        elapsed = time.monotonic() - t0
        err = info.value
        rank2 = [outs[2].get(timeout=JOIN_S) for _ in range(2)]  # sync 1, then its error
    finally:
        _reap(procs)
    assert err.peer_ranks == (1,) and err.version == 1 and err.bucket >= 0
    assert (
        "peer rank(s) [1]" in str(err)
        and f"bucket {err.bucket}" in str(err)
        and "version 1" in str(err)
    )
    assert elapsed < timeout_s + SLACK_S
    assert rank2[0][0] == 0 and rank2[1][0] == "error"
    peers, _bucket, version, _msg = rank2[1][1]
    assert peers == (1,) and version == 1  # the healthy receiver blames the dead one, not rank 0
    assert procs[0].exitcode == -signal.SIGKILL


def _stuck(port: int, rank: int, world: int, timeout_s: float, release: threading.Event) -> None:
    group = make_group(HOST, port, rank, world, timeout_s, backend="gloo", join_timeout_s=JOIN_S)
    release.wait()  # joined the group, never calls receive()
    group.close()


def test_stuck_receiver_times_out_naming_it():
    world, timeout_s = 2, 2.0
    port, release = free_port(HOST), threading.Event()
    thread = threading.Thread(target=_stuck, args=(port, 1, world, timeout_s, release), daemon=True)
    thread.start()
    try:
        sender = WeightSender(
            make_group(HOST, port, 0, world, timeout_s, backend="gloo", join_timeout_s=JOIN_S)
        )
        t0 = time.monotonic()
        with pytest.raises(TransferError) as info:
            sender.send(7, [("w", torch.ones(4))], mode="full")
        elapsed = time.monotonic() - t0
    finally:
        release.set()
        thread.join(timeout=10)
    assert (
        info.value.peer_ranks == (1,)
        and info.value.bucket == HEADER_BUCKET
        and info.value.version == 7
    )
    assert "peer rank(s) [1]" in str(info.value) and "header" in str(info.value)
    assert timeout_s - 0.1 <= elapsed < timeout_s + SLACK_S


def test_version_mismatch_aborts_cleanly_and_the_group_survives():
    """A sync set must share one version: a wrong ``receiver_version`` aborts on every rank."""
    world, timeout_s = 2, 10.0
    port = free_port(HOST)
    results: list = []

    def receive_twice() -> None:
        receiver = WeightReceiver(
            make_group(HOST, port, 1, world, timeout_s, backend="gloo", join_timeout_s=JOIN_S)
        )
        for _ in range(2):
            try:
                version, tensors = receiver.receive()
                results.append((version, {n: t.clone() for n, t in tensors}))
            except TransferError as e:
                results.append(e)

    thread = threading.Thread(target=receive_twice, daemon=True)
    thread.start()
    sender = WeightSender(
        make_group(HOST, port, 0, world, timeout_s, backend="gloo", join_timeout_s=JOIN_S)
    )
    w = torch.arange(10, dtype=torch.float32)
    with pytest.raises(TransferError, match="one sync needs them all at 5") as info:
        sender.send(1, [("w", w)], receiver_version=5, mode="sparse_delta")
    assert info.value.peer_ranks == (1,)
    stats = sender.send(1, [("w", w)], receiver_version=NO_VERSION, mode="sparse_delta")
    thread.join(timeout=10)
    assert stats.mode == "full"
    assert isinstance(results[0], TransferError) and "aborted" in str(results[0])
    assert results[1][0] == 1 and torch.equal(results[1][1]["w"], w)


def test_changed_only_lists_just_the_touched_tensors():
    world, timeout_s = 2, 10.0
    port = free_port(HOST)
    model = {f"w{i}": torch.randn(100).bfloat16() for i in range(6)}  # 1.2 KiB: one bucket
    seen: list = []

    def receive_twice() -> None:
        receiver = WeightReceiver(
            make_group(HOST, port, 1, world, timeout_s, backend="gloo", join_timeout_s=JOIN_S)
        )
        for _ in range(2):
            version, tensors = receiver.receive(changed_only=True)
            seen.append((version, {n: t.clone() for n, t in tensors}, receiver.last_stats))

    thread = threading.Thread(target=receive_twice, daemon=True)
    thread.start()
    sender = WeightSender(
        make_group(HOST, port, 0, world, timeout_s, backend="gloo", join_timeout_s=JOIN_S)
    )
    sender.send(0, model.items(), mode="sparse_delta")
    model["w1"][3] += 1
    model["w4"][0] = -0.0 if model["w4"][0] == 0 else 0.0
    sender.send(1, model.items(), receiver_version=0, mode="sparse_delta")
    thread.join(timeout=10)
    assert set(seen[0][1]) == set(model)  # a full sync touches everything
    version, tensors, stats = seen[1]
    assert version == 1 and set(tensors) == {"w1", "w4"} and stats.buckets_sparse == 1
    for name, t in tensors.items():
        assert _bits_equal(t, model[name])


class _CountingStore:
    """A store that records the keys it is asked to set."""

    def __init__(self, store, sets: list) -> None:
        self._store, self._sets = store, sets

    def set(self, key: str, value) -> None:
        self._sets.append(key)
        self._store.set(key, value)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


def test_the_header_is_one_store_message_and_no_collective():
    """Per sync, the header is the one store value ``header/<seq>`` (the sender sets it,
    each receiver gets it); the only collectives are the payloads'; a sync's keys go
    once the next sync is done."""
    world, timeout_s = 2, 10.0
    port = free_port(HOST)
    model = {f"w{i}": torch.randn(100).bfloat16() for i in range(6)}  # one bucket
    got: list = []

    def receive_twice() -> None:
        receiver = WeightReceiver(
            make_group(HOST, port, 1, world, timeout_s, backend="gloo", join_timeout_s=JOIN_S)
        )
        for _ in range(2):
            got.append(receiver.receive()[0])

    thread = threading.Thread(target=receive_twice, daemon=True)
    thread.start()
    group = make_group(HOST, port, 0, world, timeout_s, backend="gloo", join_timeout_s=JOIN_S)
    sender = WeightSender(group)
    bcasts, sets = [], []
    real_bcast = sender._bcast
    sender._bcast = lambda buf: bcasts.append(buf.numel()) or real_bcast(buf)
    group.store = _CountingStore(group.store, sets)
    first = sender.send(0, model.items(), mode="full")
    assert bcasts == [first.bytes_full]  # the one bucket; no header collective
    assert sets.count(header_key(group, 1)) == 1
    assert decode_header(group.store.get(header_key(group, 1)))["v"] == 0
    assert first.header_bytes == len(group.store.get(header_key(group, 1)))
    sender.send(1, model.items(), receiver_version=0, mode="full")
    thread.join(timeout=10)
    assert got == [0, 1] and sets.count(header_key(group, 2)) == 1
    assert not group.has(header_key(group, 1)) and not group.has(group.key("arrive", 1, 1))
    group.close()


def test_a_value_that_is_not_a_header_is_refused_in_one_line():
    good = {"v": 1, "base": 0, "mode": "full", "fp": "x", "manifest": None, "plan": [],
            "abort": None}  # fmt: skip
    assert decode_header(encode_header(good)) == good
    for data, line in [
        (b"\x00" * 16, "not a sync header"),
        (HEADER_MAGIC + b"{", "not JSON"),
        (HEADER_MAGIC + b"[1]", "is a list, not an object"),
        (HEADER_MAGIC + b'{"v": 1}', "lacks"),
    ]:
        with pytest.raises(ValueError, match=line) as e:
            decode_header(data)
        assert "\n" not in str(e.value)


def _nccl_receiver(port: int, out) -> None:
    torch.cuda.set_device(1)
    receiver = WeightReceiver(
        make_group(HOST, port, 1, 2, 30.0, backend="nccl", join_timeout_s=JOIN_S)
    )
    for _ in range(2):
        version, tensors = receiver.receive()
        out.put((version, {n: t.cpu() for n, t in tensors}, receiver.last_stats.buckets_sparse))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank (two GPUs)")
def test_nccl_sparse_sync_is_bit_exact():
    ctx = mp.get_context("spawn")
    port, out = free_port(HOST), ctx.Queue()
    proc = ctx.Process(target=_nccl_receiver, args=(port, out), daemon=True)
    proc.start()
    try:
        torch.cuda.set_device(0)
        group = make_group(HOST, port, 0, 2, 30.0, backend="nccl", join_timeout_s=JOIN_S)
        assert group.backend == "nccl" and group.device.type == "cuda"
        sender = WeightSender(group, bucket_mb=BUCKET_MB)
        model = _make_model().cuda()
        snaps = [_snapshot(model)]
        sender.send(0, _export(model), mode="sparse_delta")
        with torch.no_grad():
            model["l1_q"].weight[0, :4] += 0.5
        snaps.append(_snapshot(model))
        stats = sender.send(1, _export(model), receiver_version=0, mode="sparse_delta")
        got = [out.get(timeout=JOIN_S) for _ in range(2)]
    finally:
        _reap([proc])
    assert stats.buckets_sparse >= 1 and got[1][2] == stats.buckets_sparse
    for (version, tensors, _), snap in zip(got, snaps, strict=True):
        for name, ref in snap.items():
            assert _bits_equal(tensors[name], ref.cpu()), (version, name)


def test_a_heartbeat_is_joined_by_the_next_one_not_on_the_sync_path():
    """Leaving a Heartbeat only tells its thread to stop (a thread in the middle of a
    store write does not hold the sync up); the group's next Heartbeat joins it before
    it uses the side store, and so does the group's close."""
    group = make_group(HOST, free_port(HOST), 0, 1, 5.0, backend="gloo", join_timeout_s=JOIN_S)
    release = threading.Event()
    hb = Heartbeat(group)
    real = hb._write

    def write() -> None:  # the beat on entry writes; the thread's first beat blocks
        real() if hb._beats == 0 else release.wait()

    hb._write = write
    with hb:
        time.sleep(2 * HEARTBEAT_S)  # the thread now sits in a "write"
    assert hb._thread.is_alive()  # left without waiting for it
    threading.Timer(HEARTBEAT_S, release.set).start()
    with Heartbeat(group):
        assert not hb._thread.is_alive()  # joined before the next one beat
    group.close()
