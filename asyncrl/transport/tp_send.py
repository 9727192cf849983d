"""A sharded learner's ranks each send their own engine shard: no rank gathers the
model. Group ranks ``0..T-1`` are the learner ranks that send (rank ``r`` holds engine
rank ``r``'s shard, cut from what it holds: asyncrl/transport/reshard.py
``direct_plan``, ``direct_senders``), ranks ``T..`` the engines' workers in TP order
(worker ``g`` holds engine rank ``(g - T) % T``).

    sender r (each)                            rank 0, besides          each worker g
    wait arrive/<seq>/* ◀──────────────────────────────────────────── post arrive: held|layout|host
    plan shard r against its base (delta only
      when every worker of r holds that layout)
    r > 0: post plan/<seq>/<r> ──────────────▶ wait plan/<seq>/1..T-1
                                               any shard full: all full
                                               set header/<seq> ──────▶ get header (one store
    r > 0: get header/<seq> (the mode used)                              message): shard (g-T)%T
    send shard r's buckets to its workers ──────────────────────────▶ recv from rank (g-T)%T
      (point to point, tag = bucket)                                   (dense / sparse / skip)
    post done/<seq>/<r>                        wait done/<seq>/1..T-1   post done/<seq>/<g>

The header is rank 0's alone, as in every sync: every shard's fingerprint, manifest
(once per layout) and per-bucket plan. A worker holding another layout (whole tensors,
or shards sent another way) makes its shard, and so the sync, ``full``. Wire only: the
same-host road (asyncrl/transport/shm.py) is not taken here.
"""

from __future__ import annotations

import json
import time

import torch

from asyncrl.transport.broadcast import SendStats, WeightSender, plan_against
from asyncrl.transport.buckets import DEFAULT_BUCKET_MB, PackedModel
from asyncrl.transport.delta import Kind, Mode, ShadowStore
from asyncrl.transport.group import Heartbeat, TransferError, TransferGroup
from asyncrl.transport.spec import HEADER_BUCKET, NO_VERSION
from asyncrl.transport.wire import bucket_counts

POLL_S = 0.02  # rank 0's poll of the other learner ranks' plan and done keys


class TPShardSender(WeightSender):
    """Learner TP rank ``group.rank`` of ``tp``: its shadows hold only its own engine
    shard of each version (``snapshot`` on :class:`~asyncrl.transport.endpoint.
    SenderEndpoint` with the stream of ``engine_shard``)."""

    def __init__(
        self,
        group: TransferGroup,
        tp: int,
        shadows: ShadowStore | None = None,
        bucket_mb: float = DEFAULT_BUCKET_MB,
        shadow_device: torch.device | str | None = None,
    ):
        super().__init__(group, shadows, bucket_mb, shadow_device, sender_ranks=tp)
        self.tp = tp

    @torch.no_grad()
    def send_own(
        self,
        version: int,
        receiver_version: int,
        mode: Mode | str = Mode.SPARSE,
        arrive_timeout_s: float | None = None,
    ) -> SendStats:
        """Bring the workers of engine rank ``group.rank`` from ``receiver_version`` to
        ``version``; every learner TP rank calls this with the same arguments. Rank 0's
        stats are the whole sync's (``bytes_per_learner_rank``: what each TP rank sent);
        the others' their own part. Raises :class:`TransferError` on every live rank."""
        mode = Mode(mode)
        g, r = self.group, self.group.rank
        packed = self.shadows.get(version)
        if packed is None:
            raise KeyError(f"version {version} is not in this rank's shadows")
        self._seq += 1
        seq = self._seq
        t1 = time.perf_counter()
        try:
            with Heartbeat(g) as self._hb:
                held = self._arrivals(seq, version, arrive_timeout_s or g.timeout_s)
                t2 = time.perf_counter()
                dsts = [w for w in held if (w - self.tp) % self.tp == r]
                base = self._base(packed, receiver_version, dsts)
                used, plans = plan_against(packed, base, mode)
                mine = own_plan(packed, used, plans)
                if r == 0:
                    header, shards, header_bytes = self._header(
                        seq, version, receiver_version, held, mine
                    )
                else:
                    g.store.set(g.key("plan", seq, r), json.dumps(mine))
                    header, shards, header_bytes = self.read_header(seq), [mine], 0
                if header["abort"] is not None:
                    raise TransferError(header["abort"], [0], HEADER_BUCKET, version)
                if header["mode"] == Mode.FULL.value and used is not Mode.FULL:
                    used, plans = plan_against(packed, None, Mode.FULL)
                    base = None
                progress = {"bucket": HEADER_BUCKET}
                try:
                    self._sends(packed, base, plans, dsts, progress)
                    g.store.set(g.key("done", seq, r), "1")
                    if r == 0:
                        self._others_done(seq, version, len(plans))
                except TransferError:
                    raise
                except Exception as e:  # noqa: BLE001 - reported like any collective
                    raise self._failure(seq, version, progress["bucket"], e) from e
            t3 = time.perf_counter()
        finally:
            self._forget(seq - 1)
        return self._stats(
            version, receiver_version, header, shards, held, header_bytes, len(plans),
            bucket_counts(plans), (t2 - t1, t3 - t2),
        )  # fmt: skip

    def _stats(
        self, version: int, receiver_version: int, header: dict, shards: list[dict],
        held: dict[int, int], header_bytes: int, buckets: int, counts: dict[str, int],
        times: tuple[float, float],
    ) -> SendStats:  # fmt: skip
        """One sync's figures from this rank's view: rank 0 counts every TP rank's shards,
        the others their own."""
        wait_s, send_s = times
        r = self.group.rank
        full = header["mode"] == Mode.FULL.value
        per_shard = [sh["full_nbytes" if full else "nbytes"] for sh in shards]
        workers = [sum(1 for w in held if (w - self.tp) % self.tp == s) for s in range(self.tp)]
        ranks = range(self.tp) if r == 0 else [r]  # whose shards these are
        by_rank = [n * workers[s] for n, s in zip(per_shard, ranks, strict=True)]
        by_rank[0] += header_bytes
        sent = sum(by_rank)
        return SendStats(
            version=version, base_version=receiver_version, mode=header["mode"],
            bytes_sent=sent, header_bytes=header_bytes,
            bytes_full=sum(sh["full_nbytes"] * workers[s] for sh, s in zip(shards, ranks)),
            buckets_total=buckets, **counts, pack_seconds=0.0,
            wait_seconds=wait_s, seconds=send_s, gbps=sent / max(send_s, 1e-9) / 1e9,
            bytes_per_rank=header_bytes + max(per_shard), bytes_per_learner_rank=by_rank,
        )  # fmt: skip

    def _base(self, packed: PackedModel, version: int, dsts: list[int]) -> PackedModel | None:
        """This rank's shard of ``version`` when every worker it sends to holds that layout."""
        if version == NO_VERSION:
            return None
        fp = packed.manifest.fingerprint
        if any(self.held_layouts.get(w) != fp for w in dsts):
            return None
        return self.shadows.get(version)

    def _header(
        self, seq: int, version: int, base: int, held: dict[int, int], mine: dict
    ) -> tuple[dict, list[dict], int]:
        """Rank 0: the other ranks' plans, then the one header (set): (header, every
        shard's plan, header bytes). ``full`` for every shard when any shard is."""
        g = self.group
        others = self._wait_keys(seq, "plan", version, g.timeout_s)
        shards = [mine] + [json.loads(v) for v in others]
        abort = self._version_mismatch(held, base)
        full = any(s["mode"] == Mode.FULL.value for s in shards) or abort is not None
        fps = [s["fp"] for s in shards]
        known = self._peer_manifest == "|".join(fps)
        header = {
            "v": version,
            "base": base,
            "mode": Mode.FULL.value if full else shards[0]["mode"],
            "shards": self.tp,
            "senders": self.tp,
            "fp": fps,
            "manifest": None if known else [s["manifest"] for s in shards],
            "plan": [[[int(Kind.DENSE), 0]] * s["buckets"] if full else s["plan"] for s in shards],
            "abort": abort[0] if abort is not None else None,
            "shm": None,
        }
        header_bytes = self._announce(seq, version, header, abort, "|".join(fps))
        return header, shards, header_bytes

    def _others_done(self, seq: int, version: int, buckets: int) -> None:
        """Rank 0: wait for every other learner rank's payloads to be handed over."""
        self._wait_keys(seq, "done", version, (buckets + 2) * self.group.timeout_s)

    def _wait_keys(self, seq: int, kind: str, version: int, timeout_s: float) -> list[str]:
        """The values of ``kind/<seq>/<r>`` for learner ranks ``1..tp-1``; a rank that
        posts ``fail`` instead, or neither within ``timeout_s``, is named in the error."""
        g = self.group
        keys = {r: g.key(kind, seq, r) for r in range(1, self.tp)}
        deadline = time.monotonic() + timeout_s
        while not all(g.has(k) for k in keys.values()):
            failed = [r for r in keys if g.has(g.key("fail", seq, r))]
            if failed or time.monotonic() > deadline:
                late = failed or [r for r, k in keys.items() if not g.has(k)]
                if kind == "plan":  # the workers wait for a header: tell them
                    self.post_header(seq, abort_header(version, f"learner ranks {late} failed"))
                raise TransferError(
                    f"the sender(s) of engine shard(s) {late} did not post {kind} for sync {seq}",
                    late, HEADER_BUCKET, version,
                )  # fmt: skip
            time.sleep(POLL_S)
        return [v.decode() for v in g.store.multi_get(list(keys.values()))] if keys else []


def own_plan(packed: PackedModel, used: Mode, plans: list) -> dict:
    """One rank's shard as rank 0's header needs it (JSON)."""
    return {
        "mode": used.value,
        "fp": packed.manifest.fingerprint,
        "manifest": packed.manifest.to_bytes().decode(),
        "plan": [[int(b.kind), b.nnz] for b in plans],
        "buckets": len(plans),
        "nbytes": sum(b.nbytes for b in plans),
        "full_nbytes": packed.manifest.nbytes,
    }


def abort_header(version: int, why: str) -> dict:
    return {"v": version, "base": NO_VERSION, "mode": Mode.FULL.value, "fp": "",
            "manifest": None, "plan": [], "abort": why, "shm": None}  # fmt: skip
