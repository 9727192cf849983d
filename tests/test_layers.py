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
    assert "4 kept, 0 broken" in report


def test_the_engine_library_contract_names_every_package_but_engine():
    """``engine-library`` (pyproject.toml) forbids vllm and sglang to every package it
    lists: a new package must be listed too."""
    import tomllib

    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in conf["contracts"] if c["id"] == "engine-library"]
    tops = {p.stem for p in (ROOT / "asyncrl").iterdir()
            if not p.name.startswith("_") and (p.suffix == ".py" or (p / "__init__.py").exists())}  # fmt: skip
    assert set(contract["source_modules"]) == {f"asyncrl.{t}" for t in tops - {"engine"}}
    assert contract["forbidden_modules"] == ["vllm", "sglang"]


def test_only_the_engine_package_imports_vllm():
    r"""The seam, by text as well: ``grep -rn "import vllm\|from vllm" asyncrl/`` finds
    only files under asyncrl/engine/."""
    out = subprocess.run(
        ["grep", "-rn", r"import vllm\|from vllm", "asyncrl/"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    hits = [line.split(":", 1)[0] for line in out.stdout.splitlines()]
    assert hits, "the vLLM implementation imports vllm: the grep found nothing at all"
    assert all(h.startswith("asyncrl/engine/") for h in hits), out.stdout


def test_only_the_sglang_engine_imports_sglang():
    r"""``grep -rnE "^\s*(import|from) sglang\b" asyncrl/`` finds only
    asyncrl/engine/sglang_engine.py (its imports are inside its functions)."""
    out = subprocess.run(
        ["grep", "-rnE", r"^\s*(import|from) sglang\b", "asyncrl/"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    lines = out.stdout.splitlines()
    assert lines, "the SGLang implementation imports sglang: the grep found nothing at all"
    assert all(line.startswith("asyncrl/engine/sglang_engine.py:") for line in lines), out.stdout
    assert all(line.split(":", 2)[2].startswith(" ") for line in lines), out.stdout
