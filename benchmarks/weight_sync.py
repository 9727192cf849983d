"""Weight-sync transport: GB/s of a bucketed gloo broadcast (learner rank 0 → N
receiver processes on 127.0.0.1) against a plain tensor copy of the same bytes in
the same run, and the bytes each lossless mode sends after one realistic AdamW
step (lr 1e-6 on bf16 weights), with every sync checked bit for bit. Writes a
table, ``weight_sync.csv`` and ``weight_sync.png`` into ``--out``, and the JSON line.

    sender (this process): SenderEndpoint ── one group of all receivers (broadcast)
                                           └─ one group per receiver (rolling, k=1)
    receivers (spawned):   ReceiverEndpoint.sync ── receive, "load" (digest what it would load)

Per model size: v0 full (warm-up, establishes the receivers' copy), then one
AdamW step before each of: v1 sparse_delta, v2 changed_buckets, v3 full (the
timed GB/s), v4 rolling sparse_delta (one receiver at a time), v5 LoRA: rank-16
adapters on every matrix but the embedding, all that ``learner.lora`` sends (its
"of full" is of the whole model's bytes; the engine's merge is not timed here), v6 full
resharded: the receivers taken as engines of ``RESHARD_TP`` workers each, every worker
sent only its tensor-parallel shard (asyncrl/transport/reshard.py, the model named as a
Qwen2 decoder), beside v3's full broadcast in bytes per engine rank and seconds (no row
where the MLP width does not split ``RESHARD_TP`` ways, or the receivers do not). The same
SenderEndpoint / ReceiverEndpoint classes serve the WeightBroker and the vLLM
worker extension. ``--engine-api N``: also N ``full`` syncs of the tiny model into a real
vLLM-CPU engine through each road, asyncrl's worker extension and vLLM's own update API,
side by side (benchmarks/weight_sync_engine.py). The same-host road (``broker.shm=auto``,
asyncrl/transport/shm.py) runs beside v3: the same bytes as a ``full`` sync whose receivers
read the buckets from /dev/shm (a second SenderEndpoint, its shadows packed into shared
memory; the row ``full shm``, the JSON's ``shm_*`` keys), then ``SHM_ROUNDS`` rounds of one
full sync per road and one memcpy (the ``*_median_*`` keys). ``ratio_vs_memcpy`` stays the
gloo broadcast's single sync (``ratio_vs_memcpy_road`` says so); ``default_ratio_vs_memcpy``
is the medians' ratio of the road ``broker.shm``'s default takes with same-host receivers. ``--quick``: ~10M parameters (seconds). Without it: a sweep
from ~10M to ~500M parameters (minutes; ~10 GB of memory at the top).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: see the note in benchmarks/common.py
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import math  # noqa: E402
import multiprocessing as mp  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    emit_json,
    parser,
    print_table,
    pyplot,
    ratio,
    run_fingerprint,
    write_csv,
)

HOST = "127.0.0.1"
TIMEOUT_S = 120.0  # per collective; generous for 1 GB buckets on a loaded box
JOIN_S = 120.0  # spawned receivers import torch first
QUICK_PARAMS = [10_000_000]
LORA_RANK = 16  # `learner.lora.rank=16`
LORA_VERSION = 5  # after the schedule's v0-v4
RESHARD_TP = 2  # engine tensor-parallel size of the resharded row
RESHARD_VERSION = 6
SHM_BESIDE = 3  # the timed full sync, sent again on the same-host road
SHM_ROUNDS = 5  # then alternating full syncs per road: medians, against a shared host's noise
HEAD_DIM = 64  # the stack's attention head width (make_model's k/v: one head per 256)
SWEEP_PARAMS = [10_000_000, 50_000_000, 100_000_000, 250_000_000, 500_000_000]
# Every tensor is trained here (no frozen ones), and one AdamW step at lr 1e-6 moves ~2%
# of the bf16 elements, spread everywhere: every bucket changes, so `changed_buckets`
# sends what `full` does; it pays off only with frozen parameters (see tests/test_broker.py).


# ---- the model ------------------------------------------------------------------------------
def make_model(params: int, seed: int = 0) -> list[torch.nn.Parameter]:
    """A Qwen-shaped bf16 stack of about ``params`` parameters, N(0, 0.02) matrices,
    norms at 1.0 (names in :func:`names`)."""
    g = torch.Generator().manual_seed(seed)
    d = 256 if params < 20e6 else 512 if params < 100e6 else 1024 if params < 300e6 else 1536
    vocab = max(256, min(32_000, int(0.15 * params / d)))
    layers = max(1, round((params - vocab * d) / (12 * d * d)))
    shapes = [(vocab, d)]
    for _ in range(layers):
        shapes += [(d,), (d, d), (d // 4, d), (d // 4, d), (d, d), (d,)]  # norm, q, k, v, o, norm
        shapes += [(8 * d // 3, d), (8 * d // 3, d), (d, 8 * d // 3)]  # gate, up, down
    shapes += [(d,)]
    out = []
    for s in shapes:
        t = torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) * 0.02
        out.append(torch.nn.Parameter(t.to(torch.bfloat16)))
    return out


def names(model: list[torch.nn.Parameter]) -> list[str]:
    return [f"p{i}.{'norm' if p.dim() == 1 else 'weight'}" for i, p in enumerate(model)]


def qwen2(model: list[torch.nn.Parameter]) -> tuple[list[str], dict[str, Any]]:
    """The stack's tensors named as a Qwen2 decoder's (HF names), and its config."""
    vocab, d = model[0].shape
    out = ["model.embed_tokens.weight"]
    parts = ["input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
             "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
             "mlp.down_proj"]  # fmt: skip
    layers = (len(model) - 2) // len(parts)
    out += [f"model.layers.{i}.{p}.weight" for i in range(layers) for p in parts]
    out.append("model.norm.weight")
    config = {
        "model_type": "qwen2", "hidden_size": d, "num_attention_heads": d // HEAD_DIM,
        "num_key_value_heads": d // 4 // HEAD_DIM, "head_dim": HEAD_DIM,
        "intermediate_size": model[7].shape[0], "vocab_size": vocab, "tie_word_embeddings": True,
    }  # fmt: skip
    return out, config


def adamw_step(model: list[torch.nn.Parameter], opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(1000 + seed)
    for p in model:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(p.dtype)
    opt.step()
    opt.zero_grad(set_to_none=True)


def memcpy_gbps(nbytes: int, repeats: int = 3) -> float:
    """Best-of-``repeats`` plain tensor copy of ``nbytes``."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def lora_adapters(model: list[torch.nn.Parameter], rank: int) -> list[tuple[str, torch.Tensor]]:
    """Rank-``rank`` LoRA adapters on every matrix but the embedding, in the model's
    dtype, named as ``learner.lora`` sends them (asyncrl/engine/adapter.py): A ``[r, in]``,
    B ``[out, r]``, both moved off zero as after a few steps."""
    g = torch.Generator().manual_seed(7)
    out = []
    for i, p in enumerate(model[1:], start=1):
        if p.dim() == 2:
            (o, n), d = p.shape, p.dtype
            out.append((f"p{i}.lora_A.weight", (torch.randn(rank, n, generator=g) * 0.01).to(d)))
            out.append((f"p{i}.lora_B.weight", (torch.randn(o, rank, generator=g) * 0.01).to(d)))
    return out


# ---- receivers --------------------------------------------------------------------------------
def _receiver(inbox: Any, outbox: Any) -> None:
    """Loop: ("sync", key, port, rank, world) → one sync ("loading" = digesting what it
    would load) → (ok, digests) back."""
    torch.set_num_threads(1)
    from asyncrl.transport.endpoint import ReceiverEndpoint
    from asyncrl.transport.spec import JoinSpec

    rx = ReceiverEndpoint()
    while (cmd := inbox.get())[0] != "stop":
        _, key, port, rank, world = cmd
        spec = JoinSpec(key, HOST, port, rank, world, TIMEOUT_S, JOIN_S, "gloo", True)
        report = rx.sync(spec, lambda t: None, with_digests=True, load_shard=lambda t: None)
        outbox.put((report.ok, report.digests))
    rx.close_all()


class Receivers:
    def __init__(self, n: int):
        ctx = mp.get_context("spawn")
        self.inboxes = [ctx.Queue() for _ in range(n)]
        self.outboxes = [ctx.Queue() for _ in range(n)]
        self.procs = [
            ctx.Process(target=_receiver, args=(i, o), daemon=True)
            for i, o in zip(self.inboxes, self.outboxes)
        ]
        for p in self.procs:
            p.start()
        self.opened: set[str] = set()

    def sync(
        self, ep, key: str, members: list[int], version: int, base: int, mode: str, shards: int = 0
    ):
        """One sync of group ``key`` (receivers ``members``; ``shards`` > 1: engines of that
        many workers, each sent its shard); returns (stats, digests per member)."""

        def go(port: int) -> None:
            for rank, m in enumerate(members, start=1):
                self.inboxes[m].put(("sync", key, port, rank, len(members) + 1))

        if key not in self.opened:
            ep.open(key, len(members) + 1, on_listening=go)  # returns once all joined
            self.opened.add(key)
        else:
            go(ep.senders[key].group.port)
        stats = ep.send(key, version, base, mode, shards=shards, with_digests=shards > 1)
        got = [self.outboxes[m].get(timeout=JOIN_S + TIMEOUT_S) for m in members]
        return stats, got

    def close(self) -> None:
        for q in self.inboxes:
            q.put(("stop",))
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():  # only our own children, by handle
                p.kill()


# ---- one model size ----------------------------------------------------------------------------
def run_size(params: int, receivers: int, bucket_mb: float) -> list[dict[str, Any]]:
    from asyncrl.transport.endpoint import SenderEndpoint, digests

    model = make_model(params)
    keys = names(model)
    opt = torch.optim.AdamW(model, lr=1e-6)
    ep = SenderEndpoint(HOST, "gloo", TIMEOUT_S, JOIN_S, bucket_mb, "cpu", max_versions=2)
    shm = SenderEndpoint(HOST, "gloo", TIMEOUT_S, JOIN_S, bucket_mb, "cpu", max_versions=1,
                         shm="auto")  # fmt: skip
    rx = Receivers(receivers)
    everyone = list(range(receivers))
    rows = []
    try:
        mcp = memcpy_gbps(sum(p.numel() * p.element_size() for p in model))
        held = -1
        schedule = [(0, "full", 0), (1, "sparse_delta", 0), (2, "changed_buckets", 0),
                    (3, "full", 0), (4, "sparse_delta", 1)]  # fmt: skip
        for version, mode, k in schedule:
            if version:
                adamw_step(model, opt, version)
            snap = ep.snapshot(version, zip(keys, model), retain=[held] if held >= 0 else [])
            want = digests(ep.shadows.get(version).named_tensors())
            sets = [everyone] if k == 0 else [[m] for m in everyone]
            stats, ok = [], True
            for members in sets:
                key = "all" if k == 0 else f"r{members[0]}"
                s, got = rx.sync(ep, key, members, version, held, mode)
                stats.append(s)
                ok &= all(d == want for _, d in got)
            held = version
            rows.append(row(model, version, mode, k, receivers, snap, stats, sets, mcp, ok))
            if version == SHM_BESIDE:
                rows.append(same_host(model, keys, shm, ep, rx, everyone, mcp))
        # LoRA (`learner.lora.rank=16`): the adapters alone, a full sync of their own
        adapters = lora_adapters(model, LORA_RANK)
        snap = ep.snapshot(LORA_VERSION, iter(adapters), retain=[])
        want = digests(ep.shadows.get(LORA_VERSION).named_tensors())
        s, got = rx.sync(ep, "lora", everyone, LORA_VERSION, held, "full")
        ok = all(d == want for _, d in got)
        r = row(model, LORA_VERSION, f"lora r={LORA_RANK} full", 0, receivers, snap, [s],
                [everyone], mcp, ok)  # fmt: skip
        r["sent_frac"] = ratio(r["bytes_sent"], rows[0]["bytes_full"])  # of the whole model's
        rows.append(r)
        rows += resharded(model, ep, rx, everyone, mcp)
    finally:
        rx.close()
        ep.close_all()
        shm.release()
    return rows


def same_host(model, keys, ep, gloo, rx, everyone: list[int], mcp: float) -> dict[str, Any]:
    """v3's bytes again as a ``full`` sync on the same-host road (the receivers hold v3:
    the bytes all go, only the road differs), then ``SHM_ROUNDS`` rounds of one ``full``
    sync on each road and one memcpy, whose medians go beside the single syncs."""
    from statistics import median

    from asyncrl.transport.endpoint import digests

    snap = ep.snapshot(SHM_BESIDE, zip(keys, model), retain=[])
    want = digests(ep.shadows.get(SHM_BESIDE).named_tensors())
    s, got = rx.sync(ep, "shm", everyone, SHM_BESIDE, SHM_BESIDE, "full")
    ok = all(d == want for _, d in got)
    rounds: dict[str, list[float]] = {"gloo": [], "shm": [], "memcpy": []}
    for _ in range(SHM_ROUNDS):
        for road, end, key in (("gloo", gloo, "all"), ("shm", ep, "shm")):
            t, got = rx.sync(end, key, everyone, SHM_BESIDE, SHM_BESIDE, "full")
            ok &= all(d == want for _, d in got)
            rounds[road].append(t.gbps)
        rounds["memcpy"].append(memcpy_gbps(snap["nbytes"]))
    r = row(model, SHM_BESIDE, "full shm", 0, len(everyone), snap, [s], [everyone], mcp, ok)
    r["road"] = s.road  # "shm", or "wire" where /dev/shm had no room (said on stderr)
    r.update({f"{k}_median_gbps": median(v) for k, v in rounds.items()})
    return r


def resharded(model, ep, rx, everyone: list[int], mcp: float) -> list[dict[str, Any]]:
    """v6: a full sync to engines of ``RESHARD_TP`` workers, each sent only its shard
    (no row where the layout does not split, said on stderr)."""
    from asyncrl.transport.reshard import UnsupportedLayout, plan_for

    hf, config = qwen2(model)
    try:
        plan_for(config, [(n, tuple(p.shape)) for n, p in zip(hf, model)], RESHARD_TP)
    except UnsupportedLayout as e:
        print(f"no resharded row: {e}", file=sys.stderr)
        return []
    if len(everyone) % RESHARD_TP:
        print(f"no resharded row: {len(everyone)} receivers, TP {RESHARD_TP}", file=sys.stderr)
        return []
    ep.model_config = config
    snap = ep.snapshot(RESHARD_VERSION, zip(hf, model), retain=[])
    base = LORA_VERSION  # what the receivers hold (its shadow is gone: full anyway)
    s, got = rx.sync(ep, "tp", everyone, RESHARD_VERSION, base, "full", shards=RESHARD_TP)
    assert s.shard_digests is not None
    ok = all(d == s.shard_digests[i % RESHARD_TP] for i, (_, d) in enumerate(got))
    mode = f"full resharded tp={RESHARD_TP}"
    return [row(model, RESHARD_VERSION, mode, 0, len(everyone), snap, [s], [everyone], mcp, ok)]


def row(model, version, mode, k, receivers, snap, stats, sets, mcp, ok) -> dict[str, Any]:
    """One table row: one sync (``stats``: its sets' SendStats, ``sets`` their members)."""
    sent = sum(s.bytes_sent for s in stats)
    seconds = sum(s.seconds for s in stats)
    return {
        "params": sum(p.numel() for p in model),
        "version": version,
        "mode": mode + (f" rolling k={k}" if k else ""),
        "receivers": receivers,
        "bytes_full": snap["nbytes"],
        "bytes_sent": sent,
        "bytes_per_rank": max(s.bytes_per_rank for s in stats),  # what one worker received
        "sent_frac": ratio(sent, snap["nbytes"] * len(sets)),
        "buckets": snap["buckets"] * len(sets),
        "skipped": sum(s.buckets_skipped for s in stats),
        "sparse": sum(s.buckets_sparse for s in stats),
        "seconds": seconds,
        "gbps": sent / seconds / 1e9,
        "pack_seconds": snap["pack_seconds"],
        "memcpy_gbps": mcp,
        "bitexact": ok,
        "road": "gloo",
    }


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON figures, from the largest size's rows."""
    top = max(r["params"] for r in rows)
    by = {(r["version"]): r for r in rows if r["params"] == top and r["road"] == "gloo"}
    full, sparse, changed = by[3], by[1], by[2]
    shm = next(r for r in rows if r["params"] == top and r["mode"] == "full shm")
    return {
        "params": top,
        "receivers": full["receivers"],
        "gbps": full["gbps"],
        "memcpy_gbps": full["memcpy_gbps"],
        "ratio_vs_memcpy": ratio(full["gbps"], full["memcpy_gbps"]),
        "full_bytes": full["bytes_full"],
        "changed_buckets_bytes": changed["bytes_sent"],
        "sparse_delta_bytes": sparse["bytes_sent"],
        "sparse_delta_frac": sparse["sent_frac"],
        "rolling_bytes": by[4]["bytes_sent"],
        "lora_bytes": by[LORA_VERSION]["bytes_sent"],
        "lora_frac": by[LORA_VERSION]["sent_frac"],
        "full_bytes_per_rank": full["bytes_per_rank"],
        "full_seconds": full["seconds"],
        **(
            {
                "resharded_bytes_per_rank": by[RESHARD_VERSION]["bytes_per_rank"],
                "resharded_seconds": by[RESHARD_VERSION]["seconds"],
            }
            if RESHARD_VERSION in by
            else {}
        ),  # fmt: skip
        "bitexact": all(r["bitexact"] for r in rows),
        "ratio_vs_memcpy_road": "gloo broadcast (broker.shm=off)",
        "shm_road": shm["road"],
        "shm_gbps": shm["gbps"],
        "shm_ratio_vs_memcpy": ratio(shm["gbps"], shm["memcpy_gbps"]),
        "shm_full_seconds": shm["seconds"],
        "shm_bitexact": shm["bitexact"],
        "shm_rounds": SHM_ROUNDS,
        "gloo_median_gbps": shm["gloo_median_gbps"],
        "shm_median_gbps": shm["shm_median_gbps"],
        "memcpy_median_gbps": shm["memcpy_median_gbps"],
        "gloo_median_ratio_vs_memcpy": ratio(shm["gloo_median_gbps"], shm["memcpy_median_gbps"]),
        "shm_median_ratio_vs_memcpy": ratio(shm["shm_median_gbps"], shm["memcpy_median_gbps"]),
        "default_road": "shm (broker.shm=auto, receivers on the learner's host)",
        "default_ratio_vs_memcpy": ratio(shm["shm_median_gbps"], shm["memcpy_median_gbps"]),
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    full = [r for r in rows if r["version"] == 3 and r["road"] == "gloo"]
    shm = [r for r in rows if r["mode"] == "full shm"]
    xs = [r["params"] / 1e6 for r in full]
    a.plot(xs, [r["gbps"] for r in full], "o-", label="gloo broadcast (full)")
    a.plot([r["params"] / 1e6 for r in shm], [r["gbps"] for r in shm], "^-",
           label="same-host shared memory (full)")  # fmt: skip
    a.plot(xs, [r["memcpy_gbps"] for r in full], "s--", label="memcpy, same bytes")
    a.set(xscale="log", xlabel="parameters (M)", ylabel="GB/s", title="full sync throughput")
    a.legend()
    for v, label in [(1, "sparse_delta"), (2, "changed_buckets"), (3, "full")]:
        rs = [r for r in rows if r["version"] == v and r["road"] == "gloo"]
        b.plot([r["params"] / 1e6 for r in rs], [r["sent_frac"] for r in rs], "o-", label=label)
    b.set(xscale="log", yscale="log", xlabel="parameters (M)", ylabel="bytes sent / full",
          title="after one AdamW step (lr 1e-6, bf16)")  # fmt: skip
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = parser("weight_sync", __doc__)
    p.add_argument("--params", type=float, nargs="*", help="model sizes (default: quick/sweep)")
    p.add_argument("--receivers", type=int, default=2, help="receiver processes")
    p.add_argument("--bucket-mb", type=float, default=64.0, help="flat bucket size")
    p.add_argument("--engine-api", type=int, default=0, metavar="N",
                   help="also N full syncs of the tiny model into a vLLM-CPU engine per road: "
                   "asyncrl's worker extension and vLLM's update API (benchmarks/"
                   "weight_sync_engine.py)")  # fmt: skip
    args = p.parse_args()
    sizes = [int(x) for x in args.params] if args.params else (
        QUICK_PARAMS if args.quick else SWEEP_PARAMS
    )  # fmt: skip
    torch.set_num_threads(1)
    rows = []
    for n in sizes:
        t0 = time.perf_counter()
        rows += run_size(n, args.receivers, args.bucket_mb)
        print(f"{n / 1e6:.0f}M parameters done in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    print_table(
        f"weight sync, gloo on {HOST}, {args.receivers} receiver(s), {args.bucket_mb:g} MB buckets",
        ["params", "mode", "bytes sent", "bytes/rank", "of full", "buckets", "skipped", "sparse",
         "s", "GB/s", "memcpy GB/s", "bit-exact"],
        [[r["params"], r["mode"], r["bytes_sent"], r["bytes_per_rank"], r["sent_frac"],
          r["buckets"], r["skipped"], r["sparse"], r["seconds"], r["gbps"], r["memcpy_gbps"],
          r["bitexact"]] for r in rows],
    )  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    csv_path = write_csv(args.out / "weight_sync.csv", rows, fingerprint=run_fingerprint())
    print(f"wrote {csv_path}", file=sys.stderr)
    plot(rows, args.out / "weight_sync.png")
    print(f"wrote {args.out / 'weight_sync.png'}", file=sys.stderr)
    out = summary(rows)
    if args.engine_api:
        out["engine_api"] = engine_api_rows(args.engine_api, args.out)
    emit_json(out)


def engine_api_rows(n: int, out: Path) -> list[dict[str, Any]]:
    """The two roads into a real vLLM-CPU engine, side by side (weight_sync_engine.py)."""
    from benchmarks.weight_sync_engine import roads

    rows = roads(n)
    print_table(
        f"full sync into a vLLM-CPU engine, two roads, medians of {n} each",
        ["params", "mode", "bytes sent", "transfer s", "reload s", "update s", "bit-exact"],
        [[r["params"], r["mode"], r["bytes_sent"], r["transfer_s"], r["reload_s"],
          r["update_s"], r["bitexact"]] for r in rows],
    )  # fmt: skip
    write_csv(out / "weight_sync_engine.csv", rows, fingerprint=run_fingerprint())
    return rows


if __name__ == "__main__":
    main()
