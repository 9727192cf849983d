"""Buckets and per-bucket delta planning, in one process (no groups)."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch

from asyncrl.transport.buckets import BucketPacker, Manifest, pack, unpack
from asyncrl.transport.delta import (
    Kind,
    Mode,
    ShadowStore,
    apply_sparse,
    bits,
    encode_sparse,
    plan_bucket,
    same_bits,
    sparse_nbytes,
)

KB = 1 / 1024  # bucket_mb for a 1 KiB bucket


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    flat_a, flat_b = a.reshape(-1).contiguous(), b.reshape(-1).contiguous()
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(flat_a.view(torch.uint8), flat_b.view(torch.uint8))
    )


def _mixed_model() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("embed", torch.randn(40, 8, generator=g).bfloat16()),  # 640 B
        ("norm", torch.randn(8, generator=g)),  # fp32, 32 B
        ("big", torch.randn(1000, generator=g).bfloat16()),  # 2000 B > 1 KiB: own bucket
        ("positions", torch.arange(30, dtype=torch.int64)),  # 240 B
        ("scalar", torch.tensor(3.5)),  # 0-d
        ("empty", torch.empty(0, 4).bfloat16()),
        ("transposed", torch.randn(8, 6, generator=g).t()),  # non-contiguous fp32
        ("mask", torch.rand(10, generator=g) > 0.5),  # bool
        ("w2", torch.randn(200, generator=g).bfloat16()),  # 400 B: overflows the open bf16 bucket
    ]


def test_round_trip_mixed_dtypes_views_and_layout():
    model = _mixed_model()
    packed = pack(iter(model), bucket_mb=KB)
    out = unpack(packed.manifest, packed.buckets)
    assert [n for n, _ in sorted(out)] == sorted(n for n, _ in model)
    ref = dict(model)
    for name, t in out:
        assert _bytes_equal(t, ref[name]), name
    # Views, not copies: writing through a view lands in its bucket.
    views = dict(out)
    views["positions"][0] = 99
    assert any(b.dtype == torch.int64 and b[0] == 99 for b in packed.buckets)
    for spec, flat in zip(packed.manifest.buckets, packed.buckets, strict=True):
        assert flat.dtype == spec.dtype and flat.numel() == spec.numel and flat.is_contiguous()
        if len(spec.entries) > 1:
            assert spec.nbytes <= 1024  # only a lone oversized tensor may exceed the bucket
        ends = [e.offset + math.prod(e.shape) for e in spec.entries]
        assert [e.offset for e in spec.entries[1:]] == ends[:-1] and (
            not ends or ends[-1] == spec.numel
        )
    big = [s for s in packed.manifest.buckets if any(e.name == "big" for e in s.entries)]
    assert len(big) == 1 and [e.name for e in big[0].entries] == ["big"]


def test_manifest_is_deterministic_and_serialises():
    a = pack(_mixed_model(), bucket_mb=KB).manifest
    other_values = [(n, torch.zeros_like(t)) for n, t in _mixed_model()]
    b = pack(other_values, bucket_mb=KB).manifest
    assert a == b and a.fingerprint == b.fingerprint
    assert Manifest.from_bytes(a.to_bytes()) == a
    assert len(a.to_bytes()) < 1024  # compact: a handful of bytes per tensor
    c = pack(_mixed_model(), bucket_mb=2 * KB).manifest
    assert c.fingerprint != a.fingerprint


def test_manifest_fingerprint_is_computed_once(monkeypatch):
    m = pack(_mixed_model(), bucket_mb=KB).manifest
    calls = []
    real = Manifest.to_bytes
    monkeypatch.setattr(Manifest, "to_bytes", lambda self: calls.append(1) or real(self))
    first = m.fingerprint
    assert m.fingerprint == first and m.fingerprint == first and len(calls) == 1


def test_generator_input_is_not_held_whole():
    """Tensors of a closed bucket are released while the generator is still running."""
    refs: list[weakref.ref] = []
    alive_when_last_yielded: list[bool] = []

    def stream():
        for i in range(20):
            t = torch.full((256,), float(i))  # 1 KiB fp32: one tensor per bucket
            refs.append(weakref.ref(t))
            if i == 19:
                gc.collect()
                alive_when_last_yielded.extend(r() is not None for r in refs[:-2])
            yield f"layer{i}", t
            del t

    packed = pack(stream(), bucket_mb=KB)
    assert len(packed.buckets) == 20
    assert alive_when_last_yielded and not any(alive_when_last_yielded)
    for i, (name, t) in enumerate(unpack(packed.manifest, packed.buckets)):
        assert name == f"layer{i}" and torch.all(t == i)


def test_duplicate_names_are_rejected():
    packer = BucketPacker(bucket_mb=KB)
    packer.add("w", torch.zeros(2))
    with pytest.raises(ValueError, match="twice"):
        packer.add("w", torch.zeros(2))


def test_bits_compare_is_lossless_for_nan_and_signed_zero():
    a = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=torch.bfloat16)
    b = a.clone()
    b[0] = -0.0  # equal as floats, different bits
    bits(b)[2] = 0x7FC1  # another NaN payload: NaN either way as a float
    assert not same_bits(b, a)
    payload = encode_sparse(b, a)
    assert payload.numel() == sparse_nbytes(2, 4, 2)
    held = a.clone()
    apply_sparse(held, payload, nnz=2)
    assert _bytes_equal(held, b)


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float32, torch.int64, torch.float16, torch.bool]
)
def test_sparse_round_trip_per_dtype(dtype: torch.dtype):
    g = torch.Generator().manual_seed(1)
    base = (torch.randn(5000, generator=g) * 100).to(dtype)
    new = base.clone()
    idx = torch.randperm(5000, generator=g)[:50]
    bits(new)[idx] ^= 1  # flip the lowest bit: a change for every dtype, bool included
    plan = plan_bucket(Mode.SPARSE, new, base)
    nnz = int((bits(new) != bits(base)).sum())
    assert plan.kind is Kind.SPARSE and plan.nnz == nnz
    held = base.clone()
    apply_sparse(held, encode_sparse(new, base), plan.nnz)
    assert _bytes_equal(held, new)


def test_plan_skips_sparse_and_falls_back_to_dense():
    base = torch.randn(3000).bfloat16()
    assert plan_bucket(Mode.SPARSE, base.clone(), base).kind is Kind.SKIP
    assert plan_bucket(Mode.CHANGED, base.clone(), base).kind is Kind.SKIP
    assert plan_bucket(Mode.FULL, base.clone(), base).kind is Kind.DENSE
    assert plan_bucket(Mode.SPARSE, base.clone(), None).kind is Kind.DENSE
    few = base.clone()
    few[:10] += 1
    assert plan_bucket(Mode.CHANGED, few, base).kind is Kind.DENSE
    assert plan_bucket(Mode.SPARSE, few, base).kind is Kind.SPARSE
    # bf16 + int32 index = 6 B per change vs 2 B dense: sparse only below 1/3 changed.
    third = base.clone()
    third[:1000] += 1  # exactly 1/3: 6000 B sparse == 6000 B dense -> dense
    plan = plan_bucket(Mode.SPARSE, third, base)
    assert plan.kind is Kind.DENSE and plan.nbytes == 6000
    fewer = base.clone()
    fewer[:999] += 1
    assert plan_bucket(Mode.SPARSE, fewer, base).kind is Kind.SPARSE


def test_shadow_store_shares_unchanged_buckets_and_is_bounded():
    model = dict(_mixed_model())
    store = ShadowStore(max_versions=2)
    v0 = store.put(0, pack(model.items(), bucket_mb=KB))
    model["norm"] = model["norm"] + 1
    v1 = store.put(1, pack(model.items(), bucket_mb=KB))
    shared = [a is b for a, b in zip(v0.buckets, v1.buckets, strict=True)]
    assert shared.count(False) == 1  # only the norm's bucket was stored again
    (changed,) = [s for s, same in zip(v1.manifest.buckets, shared, strict=True) if not same]
    assert "norm" in [e.name for e in changed.entries]
    assert store.nbytes() == v0.manifest.nbytes + changed.nbytes
    store.put(2, pack(model.items(), bucket_mb=KB))
    assert store.versions() == [1, 2] and store.get(0) is None  # max_versions=2
    assert store.nbytes() == v1.manifest.nbytes  # v2 == v1 bit for bit: fully shared
    store.retain({2})
    assert store.versions() == [2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pack_and_sparse_delta_on_cuda():
    model = [(n, t.cuda()) for n, t in _mixed_model()]
    on_cpu = pack(iter(model), bucket_mb=KB, device="cpu")
    on_gpu = pack(iter(model), bucket_mb=KB, device="cuda")
    assert on_cpu.manifest == on_gpu.manifest
    for a, b in zip(on_cpu.buckets, on_gpu.buckets, strict=True):
        assert _bytes_equal(a, b.cpu())
    base = on_gpu.buckets[0]
    new = base.clone()
    bits(new)[:3] ^= 1
    plan = plan_bucket(Mode.SPARSE, new, base)
    held = base.clone()
    apply_sparse(held, encode_sparse(new, base), plan.nnz)
    assert plan.nnz == 3 and _bytes_equal(held.cpu(), new.cpu())
