"""The engine's routed-experts records (asyncrl/engine/experts.py ``RouteBook``): rows of
batched steps filed under their requests at their positions, taken by the actor's
request id and sample index as vLLM names its requests. Pure numpy: the engine-backed
check is tests/test_tiny_moe.py."""

from __future__ import annotations

import numpy as np

from asyncrl.engine import experts
from asyncrl.engine.experts import RouteBook, sample_index

L, K = 2, 2


def rows_of(values: list[int]) -> np.ndarray:
    """One row per token, every entry the token's value: ``[T, L, K]`` uint8."""
    return np.repeat(np.asarray(values, np.uint8)[:, None, None], L * K, 1).reshape(-1, L, K)


def test_vllm_request_names_map_to_samples():
    assert sample_index("g1-abc-1a2b3c4d", "g1-abc", 1) == 0
    assert sample_index("g1-abc", "g1-abc", 1) == 0  # no random suffix
    assert sample_index("3_g1-abc-1a2b3c4d", "g1-abc", 4) == 3
    assert sample_index("3_g1-abc-1a2b3c4d", "g1-abc", 1) is None  # n=1 has no prefix
    assert sample_index("4_g1-abc-1a2b3c4d", "g1-abc", 4) is None  # no sample 4 of 4
    assert sample_index("g1-abcd-1a2b3c4d", "g1-abc", 1) is None  # another request
    assert sample_index("0_g1-abc-1a2b3c4d-x", "g1-abc", 2) is None


def test_batched_steps_file_each_request_at_its_positions():
    book = RouteBook(L, K)
    a, b = "0_r-aaaaaaaa", "1_r-aaaaaaaa"
    # step 1: a's prompt in two chunks (chunked prefill), b's whole prompt
    book.file(rows_of([10, 11, 12, 20, 21]), [a, b], np.array([0, 3, 5]), np.array([0, 1, 2, 0, 1]))
    book.file(rows_of([13, 22]), [a, b], np.array([0, 1, 2]), np.array([3, 2]))
    # step 3: b alone (a waits), then a decode step for both in the other order
    book.file(rows_of([23]), [b], np.array([0, 1]), np.array([3]))
    book.file(rows_of([24, 14]), [b, a], np.array([0, 1, 2]), np.array([4, 4]))
    got = book.take("r", 2)
    assert got[0][:, 0, 0].tolist() == [10, 11, 12, 13, 14]
    assert got[1][:, 0, 0].tolist() == [20, 21, 22, 23, 24]
    assert got[0].dtype == np.uint8 and got[0].shape == (5, L, K)
    assert book.take("r", 2) == [None, None] and not book.records  # taken once


def test_a_recomputed_request_keeps_the_latest_pass():
    book = RouteBook(L, K)
    book.file(rows_of([1, 2, 3, 4]), ["r-aaaaaaaa"], np.array([0, 4]), np.arange(4))
    # preempted, then recomputed from position 0 (new weights: other experts)
    book.file(rows_of([5, 6, 7]), ["r-aaaaaaaa"], np.array([0, 3]), np.arange(3))
    (rec,) = book.take("r", 1)
    assert rec[:, 1, 1].tolist() == [5, 6, 7]


def test_records_nobody_takes_fall_off_oldest_first(monkeypatch):
    monkeypatch.setattr(experts, "KEPT_RECORDS", 3)
    book = RouteBook(L, K)
    for i in range(5):
        book.file(rows_of([i]), [f"r{i}-aaaaaaaa"], np.array([0, 1]), np.array([0]))
    assert list(book.records) == ["r2-aaaaaaaa", "r3-aaaaaaaa", "r4-aaaaaaaa"]
    assert book.take("r0", 1) == [None] and book.take("r4", 1)[0][0, 0, 0] == 4
