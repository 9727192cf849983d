"""The same-host road (asyncrl/transport/shm.py): real receiver processes, real shared
memory in /dev/shm, real gloo groups on 127.0.0.1.

Every mode (full, changed_buckets, sparse_delta, rolling, LoRA adapters, resharded
shards) must land bit for bit on both roads; the road falls back to the wire when a
receiver posts another host's identity or the arena has no room; no segment outlives
the sender's endpoint, also after a receiver is killed mid-sync; a header that names
a bad segment is refused before any byte is read.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from asyncrl.transport.broadcast import WeightSender
from asyncrl.transport.endpoint import ReceiverEndpoint, SenderEndpoint, digests
from asyncrl.transport.group import TransferError, free_port, make_group
from asyncrl.transport.receiver import WeightReceiver
from asyncrl.transport.shm import PREFIX, SHM_DIR, SegmentError, ShmArena, map_segment
from asyncrl.transport.shm_send import ShmRoad
from asyncrl.transport.spec import NO_VERSION, JoinSpec
from benchmarks.weight_sync import adamw_step, lora_adapters, make_model, qwen2

HOST = "127.0.0.1"
TIMEOUT_S = 30.0
JOIN_S = 60.0  # spawned receivers import torch first
BUCKET_MB = 1.0  # a ~2M-parameter stack spans several buckets


def _ours() -> set[str]:
    """This process's segments in /dev/shm."""
    return {n for n in os.listdir(SHM_DIR) if n.startswith(f"{PREFIX}{os.getpid()}-")}


# ---- receivers: one spawned process each, driven by a queue ---------------------------------
def _receiver(inbox, outbox, elsewhere: bool, die_at_bucket: int | None) -> None:
    torch.set_num_threads(1)
    if elsewhere:  # this receiver posts another host's identity
        import asyncrl.transport.receiver as receiver

        receiver.host_identity = lambda: "another-boot/another-host/0"
    rx = ReceiverEndpoint()
    if die_at_bucket is not None:

        def die(i: int) -> None:
            if i >= die_at_bucket:
                os._exit(17)

        rx.on_bucket = die
    while (cmd := inbox.get())[0] != "stop":
        _, key, port, rank, world = cmd
        spec = JoinSpec(key, HOST, port, rank, world, TIMEOUT_S, JOIN_S, "gloo", True)
        r = rx.sync(spec, lambda t: None, with_digests=True, load_shard=lambda t: None)
        outbox.put((r.ok, r.error, r.digests))
    rx.close_all()


class _Receivers:
    def __init__(self, n: int, elsewhere: bool = False, die_at_bucket: int | None = None):
        ctx = mp.get_context("spawn")
        self.inboxes = [ctx.Queue() for _ in range(n)]
        self.outboxes = [ctx.Queue() for _ in range(n)]
        self.procs = [
            ctx.Process(target=_receiver, args=(i, o, elsewhere and k == n - 1, die_at_bucket))
            for k, (i, o) in enumerate(zip(self.inboxes, self.outboxes, strict=True))
        ]
        for p in self.procs:
            p.start()
        self.opened: set[str] = set()

    def sync(self, ep: SenderEndpoint, key: str, members: list[int], version: int, base: int,
             mode: str, shards: int = 0):  # fmt: skip
        def go(port: int) -> None:
            for rank, m in enumerate(members, start=1):
                self.inboxes[m].put(("sync", key, port, rank, len(members) + 1))

        if key not in self.opened:
            ep.open(key, len(members) + 1, on_listening=go)
            self.opened.add(key)
        else:
            go(ep.senders[key].group.port)
        stats = ep.send(key, version, base, mode, shards=shards, with_digests=shards > 1)
        got = [self.outboxes[m].get(timeout=JOIN_S + TIMEOUT_S) for m in members]
        return stats, got

    def close(self) -> None:
        for q, p in zip(self.inboxes, self.procs, strict=True):
            if p.is_alive():
                q.put(("stop",))
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():  # our own child, by handle
                p.kill()


def _endpoint(shm: str, limit: int | None = None, config=None) -> SenderEndpoint:
    return SenderEndpoint(HOST, "gloo", TIMEOUT_S, JOIN_S, BUCKET_MB, "cpu", max_versions=3,
                          model_config=config, shm=shm, shm_limit_bytes=limit)  # fmt: skip


def _schedule(ep: SenderEndpoint, rx: _Receivers) -> list[tuple[str, str, bool]]:
    """v0 full, v1 sparse_delta, v2 changed_buckets, v3 full, v4 rolling sparse_delta,
    v5 LoRA adapters (full), v6 full resharded for TP 2; per sync (mode, road, bit-exact)."""
    model = make_model(2_000_000)
    hf, config = qwen2(model)
    ep.model_config = config
    opt = torch.optim.AdamW(model, lr=1e-6)
    out, held = [], NO_VERSION
    for version, mode, rolling in [(0, "full", False), (1, "sparse_delta", False),
                                   (2, "changed_buckets", False), (3, "full", False),
                                   (4, "sparse_delta", True)]:  # fmt: skip
        if version:
            adamw_step(model, opt, version)
        ep.snapshot(version, zip(hf, model), retain=[held] if held >= 0 else [])
        want = digests(ep.shadows.get(version).named_tensors())
        sets = [[0], [1]] if rolling else [[0, 1]]
        for members in sets:
            key = f"r{members[0]}" if rolling else "all"
            s, got = rx.sync(ep, key, members, version, held, mode)
            out.append((s.mode, s.road, all(ok and d == want for ok, _, d in got)))
        held = version
    ep.snapshot(5, iter(lora_adapters(model, 16)), retain=[])
    want = digests(ep.shadows.get(5).named_tensors())
    s, got = rx.sync(ep, "all", [0, 1], 5, held, "full")
    out.append(("lora " + s.mode, s.road, all(ok and d == want for ok, _, d in got)))
    ep.snapshot(6, zip(hf, model), retain=[])
    s, got = rx.sync(ep, "tp", [0, 1], 6, 5, "full", shards=2)
    assert s.shard_digests is not None
    exact = all(ok and d == s.shard_digests[i] for i, (ok, _, d) in enumerate(got))
    out.append(("resharded " + s.mode, s.road, exact))
    return out


@pytest.mark.parametrize("shm", ["auto", "off"])
def test_every_mode_is_bit_exact_on_either_road(shm: str):
    rx = _Receivers(2)
    ep = _endpoint(shm)
    try:
        rows = _schedule(ep, rx)
        assert len(_ours()) == (len(ep.shm.names()) if ep.shm is not None else 0)
    finally:
        rx.close()
        ep.release()
    road = "shm" if shm == "auto" else "wire"
    modes = [m for m, _, _ in rows]
    assert modes == ["full", "sparse_delta", "changed_buckets", "full", "sparse_delta",
                     "sparse_delta", "lora full", "resharded full"], modes  # fmt: skip
    assert all(exact for _, _, exact in rows), rows
    assert all(r == road for _, r, _ in rows), rows
    assert _ours() == set()


def test_a_receiver_on_another_host_sends_over_the_wire_with_one_log_line(caplog):
    rx = _Receivers(2, elsewhere=True)
    ep = _endpoint("auto")
    model = make_model(2_000_000)
    try:
        with caplog.at_level(logging.INFO, logger="asyncrl.transport.shm_send"):
            for v in range(3):
                ep.snapshot(v, zip(map(str, range(len(model))), model), retain=[v - 1])
                want = digests(ep.shadows.get(v).named_tensors())
                s, got = rx.sync(ep, "all", [0, 1], v, v - 1, "full")
                assert s.road == "wire"
                assert all(ok and d == want for ok, _, d in got)
    finally:
        rx.close()
        ep.release()
    lines = [r.getMessage() for r in caplog.records if "weight sync" in r.getMessage()]
    assert len(lines) == 1 and "not provably on this host" in lines[0], lines
    assert _ours() == set()


def test_without_room_buckets_go_over_the_wire_bit_exact():
    model = make_model(2_000_000)
    nbytes = sum(p.numel() * p.element_size() for p in model)
    for limit, road in [(1, "wire"), (nbytes // 2, "shm")]:  # none fits; about half fits
        rx = _Receivers(2)
        ep = _endpoint("auto", limit=limit)
        try:
            ep.snapshot(0, zip(map(str, range(len(model))), model))
            held = ep.shm.nbytes
            want = digests(ep.shadows.get(0).named_tensors())
            s, got = rx.sync(ep, "all", [0, 1], 0, NO_VERSION, "full")
        finally:
            rx.close()
            ep.release()
        assert s.road == road and held <= limit
        assert all(ok and d == want for ok, _, d in got)
        assert _ours() == set()


def test_a_receiver_killed_mid_sync_is_named_and_leaks_no_segment():
    rx = _Receivers(2, die_at_bucket=1)
    ep = _endpoint("auto")
    model = make_model(2_000_000)
    try:
        ep.snapshot(0, zip(map(str, range(len(model))), model))
        t0 = time.monotonic()
        with pytest.raises(TransferError) as err:
            rx.sync(ep, "all", [0, 1], 0, NO_VERSION, "full")
        assert time.monotonic() - t0 < TIMEOUT_S
        assert set(err.value.peer_ranks) <= {1, 2} and err.value.peer_ranks
        assert len(_ours()) == len(ep.shm.names())  # only the shadow's own segments
    finally:
        rx.close()
        ep.release()
    assert _ours() == set()


@pytest.fixture
def shm_dir():
    """A directory on /dev/shm's tmpfs (a disk's tmp_path may hold less than the arena's
    reserve free), removed after the test."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="asyncrl-test-", dir=SHM_DIR)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def test_a_bad_segment_reference_is_refused_before_reading(shm_dir):
    arena = ShmArena(directory=str(shm_dir))
    flat = arena.alloc(100, torch.uint8)
    flat.copy_(torch.arange(100, dtype=torch.uint8))
    (name,) = arena.names()
    assert (os.stat(shm_dir / name).st_mode & 0o777) == 0o600
    assert map_segment(name, 10, 5, str(shm_dir)).tolist() == [10, 11, 12, 13, 14]
    mine = map_segment(name, 0, 100, str(shm_dir), private=True)  # copy-on-write
    mine[0] = 255
    assert flat[0].item() == 0 and mine[0].item() == 255
    bad = [
        (("../../etc/passwd", 0, 1), "not a weight segment name"),
        ((name, 90, 20), "outside its 100 B"),
        ((name, -1, 5), "bad range"),
        ((name, 0, "5"), "bad range"),
        ((PREFIX + "1-" + "0" * 32, 0, 1), "No such file"),
    ]
    for args, line in bad:
        with pytest.raises(SegmentError, match=line):
            map_segment(*args, directory=str(shm_dir))
    os.chmod(shm_dir / name, 0o644)
    with pytest.raises(SegmentError, match="not 600"):
        map_segment(name, 0, 1, str(shm_dir))
    del flat
    arena.release()
    assert os.listdir(shm_dir) == []


def _minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.parametrize("private", [True, False])
def test_mapping_a_segment_maps_no_page_until_it_is_read(shm_dir, private: bool):
    """``map_segment`` leaves every page to the first read, which maps many pages per fault
    (the kernel's fault-around): populating the mapping up front walked it page by page
    and took longer than the read after it (docs/weight_sync.md)."""
    nbytes = 8 << 20
    arena = ShmArena(directory=str(shm_dir))
    flat = arena.alloc(nbytes, torch.uint8)
    flat.fill_(7)
    (name,) = arena.names()
    out = torch.zeros(nbytes, dtype=torch.uint8)  # its own pages faulted in by zeros()
    pages = nbytes // 4096
    f0 = _minor_faults()
    view = map_segment(name, 0, nbytes, str(shm_dir), private=private)
    f1 = _minor_faults()
    out.copy_(view)
    f2 = _minor_faults()
    assert f1 - f0 < 16, f"mapping faulted {f1 - f0} pages in"
    assert 0 < f2 - f1 < pages // 4, f"reading {pages} pages took {f2 - f1} faults"
    assert torch.equal(out, flat)
    del view, flat
    arena.release()


def test_broker_shm_is_checked_before_ray():
    from asyncrl.broker.settings import SHM_MODES, BrokerSettings
    from asyncrl.config import ConfigError
    from asyncrl.transport.shm import MODES

    assert SHM_MODES == MODES
    assert BrokerSettings.defaults().shm in SHM_MODES
    with pytest.raises(ConfigError, match=r"broker\.shm='tmpfs'"):
        BrokerSettings.defaults(shm="tmpfs")


class _HostileRoad(ShmRoad):
    """Names a range past the end of each bucket's segment in its header."""

    def refs(self, packed, plans, encode):
        refs = super().refs(packed, plans, encode)
        return [[r[0], r[2], r[2]] if r is not None else None for r in refs]


def _receive_into(port: int, out: list) -> None:
    group = make_group(HOST, port, 1, 2, 5.0, backend="gloo", join_timeout_s=JOIN_S)
    try:
        WeightReceiver(group).receive()
        out.append(None)
    except TransferError as e:
        out.append(e)
    finally:
        group.close()


def test_a_hostile_header_fails_the_sync_on_both_ends_with_one_line():
    """A header whose segment range lies outside the segment: the receiver refuses it
    before reading (its TransferError says so) and the sender's sync fails naming it."""
    port, got = free_port(HOST), []
    thread = threading.Thread(target=_receive_into, args=(port, got), daemon=True)
    thread.start()
    arena = ShmArena()
    try:
        group = make_group(HOST, port, 0, 2, 5.0, backend="gloo", join_timeout_s=JOIN_S)
        sender = WeightSender(group, bucket_mb=1.0, shm=arena)
        sender.road = _HostileRoad(group, arena)
        model = make_model(2_000_000)
        with pytest.raises(TransferError) as sent:
            sender.send(0, zip(map(str, range(len(model))), model), mode="full")
        group.close()
    finally:
        thread.join(timeout=30)
        arena.release()
    (err,) = got
    assert isinstance(err, TransferError) and "outside its" in str(err), err
    assert sent.value.peer_ranks == (1,) and "outside its" in str(sent.value), sent.value
    assert _ours() == set()


def test_a_reserve_larger_than_the_free_space_keeps_buckets_in_ordinary_memory(shm_dir):
    free = os.statvfs(shm_dir).f_bavail * os.statvfs(shm_dir).f_frsize
    arena = ShmArena(directory=str(shm_dir), reserve_bytes=free + 1)
    flat = arena.alloc(100, torch.uint8)  # no segment: the wire carries it
    assert arena.names() == [] and arena.segment_of(flat) is None
    assert "keeps" in arena.room(1) and "do not fit" in arena.room(1)
    roomy = ShmArena(directory=str(shm_dir), reserve_bytes=0)
    kept = roomy.alloc(100, torch.uint8)
    assert len(roomy.names()) == 1 and roomy.segment_of(kept) is not None
    del kept
    roomy.release()


class _Watching(WeightReceiver):
    """Records, at its claim, whether the held bucket it replaced is still mapped."""

    def __init__(self, group, seen: list):
        super().__init__(group)
        self.seen, self.old = seen, None

    def _claim(self, seq: int) -> None:
        self.seen.append(("at claim", self.old is not None and self.old() is not None))
        super()._claim(seq)


def _receive_twice(port: int, seen: list) -> None:
    import weakref

    group = make_group(HOST, port, 1, 2, 10.0, backend="gloo", join_timeout_s=JOIN_S)
    rx = _Watching(group, seen)
    try:
        for _ in range(2):
            rx.receive()
            held = rx.held().buckets[0]
            seen.append(("after", rx.old is not None and rx.old() is not None))
            rx.old = weakref.ref(held)
            del held
    finally:
        group.close()


def test_the_receiver_unmaps_a_replaced_bucket_right_after_its_claim():
    """A dense bucket on the same-host road replaces the held one with the segment's
    mapping; the bucket it replaced stays mapped until the receiver claimed the sync (so
    freeing its pages is not on the sender's wait) and is gone when receive returns."""
    port, seen = free_port(HOST), []
    thread = threading.Thread(target=_receive_twice, args=(port, seen), daemon=True)
    thread.start()
    arena = ShmArena()
    try:
        group = make_group(HOST, port, 0, 2, 10.0, backend="gloo", join_timeout_s=JOIN_S)
        sender = WeightSender(group, bucket_mb=64.0, shm=arena)
        model = make_model(2_000_000)
        assert sender.send(0, zip(map(str, range(len(model))), model), mode="full").road == "shm"
        assert sender.send(0, None, receiver_version=0, mode="full").road == "shm"
        thread.join(timeout=30)
        group.close()
    finally:
        arena.release()
    assert seen == [("at claim", False), ("after", False), ("at claim", True), ("after", False)]
    assert _ours() == set()
