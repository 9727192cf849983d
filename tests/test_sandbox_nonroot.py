"""The sandbox as a user without root, on this machine: a throwaway user (created and
deleted here) runs the start-up check and grades through bubblewrap's unprivileged user
namespaces; where the isolation asked for is unavailable it exits 2 with one line naming
``sandbox.isolation``; ``sandbox.isolation=none`` warns and runs unconfined.

The user runs Debian's /usr/bin/python3 (this venv lives under /root, which other users
cannot enter), with the worktree on PYTHONPATH: asyncrl.sandbox needs only the stdlib."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = "/usr/bin/python3"
NO_BWRAP_PATH = "/nonexistent"  # a PATH without bwrap: the isolation is unavailable
SCRIPT = r"""
import json, os, sys
from asyncrl.config import ConfigError
from asyncrl.sandbox import SandboxSettings, grade_with
from asyncrl.sandbox.hostile import CASES, CORRECT, check, new_tag, program
from asyncrl.sandbox.isolation import require
from asyncrl.sandbox.settings import Isolation
# conf/'s sandbox node, composed by the test (this interpreter has no Hydra)
node = json.loads(os.environ["ASB_SANDBOX"])
node.update(isolation=Isolation(sys.argv[1]), timeout_s=2.0, python=sys.executable)
s = SandboxSettings(**node)
try:
    require(s)
except ConfigError as e:
    print(e)
    sys.exit(2)
out = {"correct": grade_with(CORRECT, CASES, s).reward}
for name in sys.argv[2:]:
    tag = new_tag()
    g = grade_with(program(name, tag), CASES, s)
    out[name] = check(name, g, tag, s.timeout_s).reasons
out["isolation"] = g.isolation if sys.argv[2:] else ""
out["after"] = grade_with(CORRECT, CASES, s).reward
print(json.dumps(out))
"""
# as the user's own uid, so the programs that only its uid would stop are left out
HOSTILE = ["nested_userns", "vsock", "sysv_shm", "memfd_hog", "forge_channel", "kill_parent",
           "read_host", "write_outside", "sockets", "fork_bomb", "detached_daemon", "thread_bomb",
           "memory_hog", "signal_games", "hash_collision"]  # fmt: skip

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0
    or not all(map(shutil.which, ("useradd", "userdel", "runuser")))
    or not os.path.exists(PYTHON),
    reason="needs root (to create a user), useradd/runuser and /usr/bin/python3",
)


def closed_to_others(path: Path) -> Path | None:
    """The first directory from / down to ``path`` that other users cannot enter (no
    o+x), or None: the throwaway user needs the worktree on its PYTHONPATH."""
    for d in [*reversed(path.parents), path]:
        if not os.stat(d).st_mode & 0o001:
            return d
    return None


@pytest.fixture(scope="module")
def user():
    closed = closed_to_others(ROOT)
    assert closed is None, (
        f"{closed} is closed to other users (mode {os.stat(closed).st_mode & 0o777:o}): the "
        "throwaway user cannot import asyncrl from this worktree; clone it where others can read"
    )
    name = "asb" + secrets.token_hex(4)
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/false", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], check=False)
        assert subprocess.run(["id", name], capture_output=True).returncode != 0


def run_as(user: str, isolation: str, *programs: str, path: str = "/usr/bin:/bin"):
    from asyncrl.config import defaults

    env = {"PATH": path, "PYTHONPATH": str(ROOT), "HOME": "/nonexistent", "LANG": "C.UTF-8",
           "ASB_SANDBOX": json.dumps(defaults("sandbox"))}  # fmt: skip
    cmd = ["runuser", "-u", user, "--", "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in env.items()),
           PYTHON, "-B", "-c", SCRIPT, isolation, *programs]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd="/")


@pytest.mark.slow
def test_grades_and_contains_as_a_user_without_root(user):
    r = run_as(user, "bwrap", *HOSTILE)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["isolation"] == "bwrap-userns"
    assert out["correct"] == 1.0 and out["after"] == 1.0
    assert {k: v for k, v in out.items() if k in HOSTILE and v} == {}


def test_unavailable_isolation_exits_2_with_one_line(user):
    r = run_as(user, "bwrap", path=NO_BWRAP_PATH)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sandbox.isolation=bwrap:"), lines
    assert "bubblewrap" in lines[0]


def test_isolation_none_warns_and_runs_unconfined(user):
    r = run_as(user, "none", "exit_early")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "WARNING: sandbox.isolation=none" in r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["isolation"] == "none" and out["correct"] == 1.0
