"""benchmarks/cpu_by_process.py reads the CPU seconds of a command and of its children
from /proc, by process name, over time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
# a child that spins for 1.5 s of wall time on one core: up to 1.5 CPU seconds (far less
# on a loaded host: at load 15 on 2 cores, ~0.2), never more than its wall time
SPIN = "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"


def test_a_spinning_child_is_counted_under_its_parent(tmp_path):
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {SPIN!r}])"
    cmd = [sys.executable, "-m", "benchmarks.cpu_by_process", "--out", str(tmp_path), "--",
           sys.executable, "-c", parent]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in (tmp_path / "cpu.jsonl").read_text().splitlines()]
    assert len(rows) >= 2 and all(b["t"] > a["t"] for a, b in zip(rows, rows[1:]))
    last = rows[-1]["cpu"]
    total = sum(last.values())
    # sampled every 0.5 s, so the last reading may miss up to half a second of the spin
    assert 0.05 <= total <= 2.0 + 0.5, last
    assert all(v >= 0 for v in last.values())
