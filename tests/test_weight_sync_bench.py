"""benchmarks/weight_sync.py at its smallest: runs in seconds, prints a table and,
as its last stdout line, the JSON figures, every mode bit-exact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.slow
def test_weight_sync_benchmark_smallest_settings(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "weight_sync.py"), "--quick",
           "--params", "300000", "--receivers", "2", "--bucket-mb", "0.0625",
           "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    assert "weight sync" in done.stdout and "sparse_delta" in done.stdout  # the table
    for key in ("gbps", "memcpy_gbps", "ratio_vs_memcpy", "full_bytes", "changed_buckets_bytes",
                "sparse_delta_bytes", "bitexact"):  # fmt: skip
        assert key in figures, key
    assert figures["bitexact"] is True
    assert (tmp_path / "weight_sync.csv").is_file() and (
        tmp_path / "weight_sync.png"
    ).stat().st_size
    assert figures["gbps"] > 0 and figures["memcpy_gbps"] > 0
    # one AdamW step at lr 1e-6 on bf16 moves ~2% of the elements: sparse is far smaller
    assert figures["sparse_delta_bytes"] < 0.2 * figures["full_bytes"]
    assert figures["sparse_delta_bytes"] < figures["changed_buckets_bytes"]
    assert figures["changed_buckets_bytes"] <= figures["full_bytes"] * 1.01
    # two receivers as one engine of TP 2: each worker gets about half of the full broadcast
    assert 0.4 < figures["resharded_bytes_per_rank"] / figures["full_bytes_per_rank"] < 0.6
    assert "full resharded tp=2" in done.stdout
    # rank-16 adapters on a d=256 stack: about a tenth of the model
    assert 0 < figures["lora_bytes"] < 0.25 * figures["full_bytes"]
