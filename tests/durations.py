"""Each test file's seconds in a full run, for ordering the work across pytest-xdist's
workers (tests/conftest.py): the longest groups start first, so that two workers end
together. Refresh after a full run that wrote a JUnit report:

    scripts/test.sh --junitxml=/tmp/junit.xml
    .venv/bin/python tests/durations.py /tmp/junit.xml

A file missing from the table counts as a fast one (it runs after the known slow ones)."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

TABLE = Path(__file__).with_name("durations.json")


def file_seconds(junit: Path) -> dict[str, float]:
    """Seconds per test file (setup, call and teardown), from a JUnit report."""
    seconds: Counter[str] = Counter()
    for case in ET.parse(junit).iter("testcase"):
        module = case.get("classname", "").split(".")
        if len(module) >= 2 and module[0] == "tests":
            seconds[f"{module[1]}.py"] += float(case.get("time", 0))
    return {f: round(s, 1) for f, s in sorted(seconds.items())}


def load() -> dict[str, float]:
    return json.loads(TABLE.read_text()) if TABLE.is_file() else {}


if __name__ == "__main__":
    table = file_seconds(Path(sys.argv[1]))
    TABLE.write_text(json.dumps(table, indent=0, sort_keys=True) + "\n")
    print(f"{TABLE}: {len(table)} files, {sum(table.values()) / 60:.1f} min")
