"""What both ends of one weight sync share: the wire protocol and its plumbing.
The sender is :class:`~asyncrl.transport.broadcast.WeightSender` (learner rank 0),
the receivers :class:`~asyncrl.transport.receiver.WeightReceiver` (vLLM workers).

    store (TransferGroup.key):  arrive/<seq>/<rank> = "<held version>|<its layout's fingerprint>|<host>"
                                header/<seq>         the sync's header, one message (below)
                                done/<seq>/<rank>    the rank finished sync <seq>
                                fail/<seq>/<rank>    why it failed (repr of the error)
                                read/<seq>/<rank>    same-host road: "read" (the receiver holds every
                                                     segment's bytes) or ABANDONED (the sender gave
                                                     up first), set once, atomically (compare_set)
                                at/<seq>/<rank>      same-host road: the bucket the receiver is at
                                plan/<seq>/<rank>    a TP learner rank > 0: its shard's plan (tp_send.py)
    header:     one store value, ``header/<seq>`` = HEADER_MAGIC + JSON: v, base, mode, fp,
                manifest (once per bucket layout), plan [[kind, nnz], ...], abort, shm
                (same-host road: per bucket [segment, offset, nbytes] or null); the sender
                sets it once, each receiver's ``get`` waits for it: one round trip per end.
                Resharded: ``shards`` (engine TP size) and per shard fp, manifest, plan, shm;
                ``senders`` (tp_send.py: a TP learner's ranks, rank s sending shard s; absent:
                rank 0 sends all); receiver g takes shard (g - senders) % shards
    payloads:   one bcast per non-skipped bucket, in bucket order: a dense bucket's
                bytes, or a sparse one's encoding (delta.py encode_sparse)
"""

from __future__ import annotations

import datetime
import json
import time

import torch
import torch.distributed as dist

from asyncrl.transport.buckets import Manifest
from asyncrl.transport.delta import BucketPlan, Kind, sparse_nbytes
from asyncrl.transport.group import Heartbeat, TransferError, TransferGroup, diagnose, wait_work
from asyncrl.transport.spec import HEADER_BUCKET

# Two payloads in flight: the wire stays busy while the next one is encoded,
# and memory stays at two buckets rather than the whole sync.
INFLIGHT = 2
ABANDONED = "abandoned"  # read/<seq>/<rank> when the sender gave up before the claim
HEADER_MAGIC = b"ARLW1"  # leads every header: catches a value that is not one
# The keys the sender deletes once every rank is past their sync (the store keeps no more
# than two syncs' worth).
SYNC_KEYS = ("arrive", "done", "fail", "read", "at", "plan")


def header_key(group: TransferGroup, seq: int) -> str:
    """The store key of sync ``seq``'s header."""
    return group.key("header", seq)


def encode_header(header: dict) -> bytes:
    return HEADER_MAGIC + json.dumps(header, separators=(",", ":")).encode()


def decode_header(data: bytes) -> dict:
    """A header as the sender encoded it; raises ValueError in one line naming what is
    wrong (not a header, not JSON, not an object, a field missing)."""
    if not data.startswith(HEADER_MAGIC):
        raise ValueError(f"not a sync header (starts {bytes(data[:8])!r}): ranks are out of step")
    try:
        header = json.loads(data[len(HEADER_MAGIC) :].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"sync header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"sync header is a {type(header).__name__}, not an object")
    missing = [
        k for k in ("v", "base", "mode", "fp", "manifest", "plan", "abort") if k not in header
    ]
    if missing:
        raise ValueError(f"sync header lacks {missing}")
    return header


def bcast_opts(timeout_s: float) -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    opts.timeout = datetime.timedelta(seconds=timeout_s)
    return opts


class SyncEnd:
    """Shared plumbing: sequence numbers, the header, failure diagnosis."""

    def __init__(self, group: TransferGroup):
        self.group = group
        self._seq = 0
        self._opts = bcast_opts(group.timeout_s)
        self._hb: Heartbeat | None = None  # set while a sync runs

    def _bcast(self, buf: torch.Tensor) -> dist.Work:
        return self.group.pg.broadcast([buf], self._opts)

    def _wait(self, work: dist.Work) -> None:
        hb = self._hb
        if hb is not None:
            hb.enter("wait")
        try:
            wait_work(self.group, work, time.monotonic() + self.group.timeout_s)
        finally:
            if hb is not None:
                hb.enter("work")

    def post_header(self, seq: int, header: dict) -> int:
        """The sender's half: sync ``seq``'s header as one store message; returns its size."""
        data = encode_header(header)
        self.group.store.set(header_key(self.group, seq), data)
        return len(data)

    def read_header(self, seq: int) -> dict:
        """A receiver's half: wait for sync ``seq``'s header (the store's timeout, which
        is the group's) and decode it."""
        hb = self._hb
        if hb is not None:
            hb.enter("wait")
        try:
            data = self.group.store.get(header_key(self.group, seq))
        finally:
            if hb is not None:
                hb.enter("work")
        try:
            return decode_header(data)
        except ValueError as e:
            raise TransferError(str(e), [0], HEADER_BUCKET) from None

    def _failure(
        self, seq: int, version: int | None, bucket: int, exc: BaseException
    ) -> TransferError:
        """Report our failure, then name the peers that went silent (dead or stuck)."""
        g = self.group
        try:
            g.store.set(g.key("fail", seq, g.rank), repr(exc)[:500])
            others = [r for r in range(g.world_size) if r != g.rank]
            silent, stuck = diagnose(g, seq, others)
        except Exception:  # noqa: BLE001 - the store lives on rank 0: if it is gone, so is rank 0
            silent, stuck = ([0] if g.rank != 0 else []), []
        if silent:
            reason = f"peer went silent (dead or frozen): {exc}"
            peers = silent
        elif stuck:
            reason = f"peer is alive but stuck outside the transfer: {exc}"
            peers = stuck
        else:
            reason = f"collective failed with every peer alive: {exc}"
            peers = (
                [0]
                if g.rank != 0
                else [r for r in range(1, g.world_size) if not g.has(g.key("done", seq, r))]
            )
        return TransferError(reason, peers, bucket, version)


def payload_nbytes(manifest: Manifest, i: int, plan: BucketPlan) -> int:
    """Bytes on the wire for bucket ``i`` under ``plan``."""
    spec = manifest.buckets[i]
    if plan.kind is Kind.SKIP:
        return 0
    if plan.kind is Kind.DENSE:
        return spec.nbytes
    return sparse_nbytes(plan.nnz, spec.numel, spec.dtype.itemsize)


def bucket_counts(plans: list[BucketPlan]) -> dict[str, int]:
    """How many buckets a sync skipped, sent sparse and sent dense."""
    return {
        "buckets_skipped": sum(p.kind is Kind.SKIP for p in plans),
        "buckets_sparse": sum(p.kind is Kind.SPARSE for p in plans),
        "buckets_dense": sum(p.kind is Kind.DENSE for p in plans),
    }
