"""scripts/uv_flags.py: pip's configured sources and constraints as uv flags, so that
scripts/setup.sh's uv installs from the same places as pip would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "uv_flags.py"


def flags(pip_config_list: str) -> list[str]:
    r = subprocess.run([sys.executable, str(SCRIPT)], input=pip_config_list,
                       capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    return r.stdout.split()


def test_each_source_and_constraint_becomes_its_flag_and_the_environment_wins():
    listing = "\n".join([
        ":env:.cert='/etc/ssl/certs/ca-certificates.crt'",
        ":env:.find-links='/opt/wheels'",
        "global.cert='/etc/ssl/certs/ca-certificates.crt'",
        "global.constraint='/etc/xdg/pip/constraints.txt'",
        "global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'",
        "global.find-links='/elsewhere'",
        "global.index-url=\"https://example.invalid/simple\"",
        "global.timeout='180'",
    ])  # fmt: skip
    got = flags(listing)
    pairs = list(zip(got[::2], got[1::2], strict=True))
    assert sorted(pairs) == sorted([
        ("--find-links", "/opt/wheels"),  # the environment's, not the file's /elsewhere
        ("--constraint", "/etc/xdg/pip/constraints.txt"),
        ("--extra-index-url", "file:///opt/pypi/simple"),
        ("--extra-index-url", "file:///opt/pypi-more/simple"),
        ("--index-url", "https://example.invalid/simple"),
    ])  # fmt: skip


def test_nothing_configured_is_no_flag():
    assert flags("") == []
    assert flags("global.timeout='60'\nnot a config line\n") == []
