"""Print pip's configured package sources and constraints as uv flags.

Reads ``pip config list`` on stdin (lines such as ``global.find-links='/opt/wheels'``;
pip lists the environment's ``:env:`` values first, and they win) and prints
``--find-links /opt/wheels --extra-index-url ...``, so that scripts/setup.sh's uv
installs from the same places, under the same constraints, as pip would.
"""

import re
import sys

FLAGS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}


def main() -> None:
    got: dict[str, list[str]] = {}
    for line in sys.stdin:
        m = re.match(r"(.*?)\.([a-z-]+)=(.*)$", line.strip())
        if m and m[2] in FLAGS and m[2] not in got:
            got[m[2]] = m[3].strip("'\"").split()
    print(" ".join(f"{FLAGS[k]} {v}" for k, vs in got.items() for v in vs))


if __name__ == "__main__":
    main()
