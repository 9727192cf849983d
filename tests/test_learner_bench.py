"""Smoke test of ``benchmarks/learner.py --quick`` at its smallest settings: it runs,
prints a table, and its last line is the JSON summary (no speed asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_quick_benchmark_prints_a_json_summary_last():
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "learner.py"), "--quick", "--model", "tiny",
         "--steps", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    for key in ("tokens_per_s", "baseline_tokens_per_s", "ratio", "packing_efficiency"):
        assert summary[key] > 0, key
    assert summary["ratio"] == round(summary["tokens_per_s"] / summary["baseline_tokens_per_s"], 3)
    assert summary["packing_efficiency"] >= 0.95 > summary["padded_efficiency"]
    assert "tokens_per_s" in lines[0] and "baseline_tokens_per_s" in lines[0]  # the table
