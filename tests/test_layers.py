"""The layer contracts of pyproject.toml (docs/architecture.md, "Layers"), checked by
import-linter over every import in asyncrl/, function-level ones included."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_lint_imports_keeps_every_contract():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe, "lint-imports is missing: scripts/setup.sh installs it (asyncrl[dev])"
    out = subprocess.run(
        [exe, "--no-cache", str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = out.stdout + out.stderr
    assert out.returncode == 0, report[report.find("Broken contracts") :] or report
    assert "3 kept, 0 broken" in report
