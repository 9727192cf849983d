"""What both ends of one weight sync share: the wire protocol and its plumbing.
The sender is :class:`~asyncrl.transport.broadcast.WeightSender` (learner rank 0),
the receivers :class:`~asyncrl.transport.receiver.WeightReceiver` (vLLM workers).

    store (TransferGroup.key):  arrive/<seq>/<rank> = "<held version>|<its layout's fingerprint>"
                                done/<seq>/<rank>    the rank finished sync <seq>
                                fail/<seq>/<rank>    why it failed (repr of the error)
                                read/<seq>/<rank>    same-host road: "read" (the receiver holds every
                                                     segment's bytes) or ABANDONED (the sender gave
                                                     up first), set once, atomically (compare_set)
                                at/<seq>/<rank>      same-host road: the bucket the receiver is at
    header:     bcast [MAGIC, nbytes] (int64), then nbytes of JSON: v, base, mode, fp,
                manifest (once per bucket layout), plan [[kind, nnz], ...], abort
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

# Two payloads in flight: the wire stays busy while the next one is encoded,
# and memory stays at two buckets rather than the whole sync.
INFLIGHT = 2
ABANDONED = "abandoned"  # read/<seq>/<rank> when the sender gave up before the claim
MAGIC = 0x4152_4C57  # "ARLW": catches a receiver reading a bucket as a header


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

    def _header(self, header: dict | None) -> tuple[dict, int]:
        """Broadcast ``[magic, nbytes]`` then ``nbytes`` of JSON; returns the header
        (on every rank) and its size on the wire."""
        g = self.group
        data = json.dumps(header, separators=(",", ":")).encode() if header is not None else b""
        meta = torch.tensor([MAGIC, len(data)], dtype=torch.int64, device=g.device)
        self._wait(self._bcast(meta))
        magic, nbytes = meta.tolist()
        if magic != MAGIC:
            raise RuntimeError(f"header magic {magic:#x} != {MAGIC:#x}: ranks are out of step")
        if header is not None:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(g.device)
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=g.device)
        self._wait(self._bcast(buf))
        if header is None:
            header = json.loads(bytes(buf.cpu().numpy()).decode())
        return header, meta.numel() * meta.element_size() + nbytes

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
