"""The GPU check scripts run their ``--dry-run-on-cpu`` mode (cpu/gloo in place of
cuda/nccl, the same code) so they cannot rot between the sessions lent a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def run_script(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def last_json(r: subprocess.CompletedProcess) -> dict:
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads([line for line in r.stdout.splitlines() if line.strip()][-1])


def test_gpu_check_dry_run_on_cpu():
    f = last_json(run_script("gpu_check.py", "--dry-run-on-cpu"))
    assert f["ok"] is True
    assert f["checks"]["two-rank NCCL sync across two GPUs"] == "SKIP"
    assert list(f["checks"].values()).count("PASS") == 5
    assert 0 < f["sparse_frac"] < 0.5 and f["cuda_delta_gbps"] > 0
    assert len(f["nccl_one_full_seconds"]) == 2


@pytest.mark.parametrize("size, minibatches", [("tiny", 2), ("0.5b", 1)])
def test_gpu_learner_check_dry_run_on_cpu(size, minibatches):
    args = ("--dry-run-on-cpu", "--size", size, "--minibatches", str(minibatches))
    f = last_json(run_script("gpu_learner_check.py", *args))
    assert f["passed"] is True and f["size"] == size and f["sharded"] is False
    assert f["minibatches"] == minibatches
    assert f["tokens_per_s"] > 0 and f["stream_to_cpu_gbps"] > 0 and f["first_step_s"] > 0


def test_gpu_learner_check_refuses_an_unknown_size():
    r = run_script("gpu_learner_check.py", "--dry-run-on-cpu", "--size", "7b")
    assert r.returncode != 0 and "--size must be one of" in r.stderr
