"""Hostile programs against the sandbox (asyncrl/sandbox/hostile.py holds them). Each one:
reward 0, finished within its limit, no process or file left (scanned in /proc and on
disk by marker), the grader's secrets unseen, and the next grading of a correct solution
scores 1. Then the subset that is safe to run without namespaces, in that mode."""

from __future__ import annotations

import os
import socket
import time

import pytest

from asyncrl.sandbox import SandboxSettings, SandboxUnavailable, detect, grade_with
from asyncrl.sandbox.hostile import (
    CASES,
    CORRECT,
    HOSTILE,
    SECRET_ENV,
    check,
    leftovers,
    new_tag,
    program,
)

LIMITS = SandboxSettings.defaults(timeout_s=1.0)
SECRET = "s3cr3t-" + new_tag()
USES_TIME_LIMIT = {
    "infinite_loop",
    "sleep_forever",
    "fork_bomb",
    "fork_memory_hog",
    "stack_overflow",
    "signal_games",
}
DAEMON_WAKE_S = 1.5  # the detached daemon writes its file after 1 s if it survived

needs_ns = pytest.mark.skipif(
    not detect("bwrap").namespaces, reason="bubblewrap cannot isolate here"
)


def _param(name: str):
    return pytest.param(name, marks=[pytest.mark.slow] if name in USES_TIME_LIMIT else [])


@needs_ns
@pytest.mark.parametrize("name", [_param(n) for n in HOSTILE])
def test_hostile_program_is_contained(name, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)
    tag = new_tag()
    g = grade_with(program(name, tag), CASES, LIMITS)
    c = check(name, g, tag, LIMITS.timeout_s)
    assert c.contained, (c.reasons, g)
    assert g.isolation in ("bwrap", "bwrap-userns")
    assert grade_with(CORRECT, CASES, LIMITS).reward == 1.0
    if name == "detached_daemon":
        time.sleep(DAEMON_WAKE_S)
        assert leftovers(tag, g.run_id) == []


@needs_ns
def test_no_secret_or_host_file_is_readable(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)
    g = grade_with(program("read_host", new_tag()), CASES, LIMITS)
    seen = g.output + "".join(c.got for c in g.cases)
    assert "PermissionError" in seen and "FileNotFoundError" in seen, g  # /etc/shadow, repo
    assert SECRET not in seen
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    assert readme[:200] not in seen


@needs_ns
def test_loopback_connect_fails_inside():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        srv.setblocking(False)
        port = srv.getsockname()[1]
        src = (
            "import socket\ndef f():\n    try:\n"
            f"        socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "        return 'connected'\n    except OSError as e:\n        return str(e)\n"
        )
        g = grade_with(src, [{"call": "f()", "expected": "connected"}], LIMITS)
        with pytest.raises(BlockingIOError):
            srv.accept()  # nobody came
    assert g.reward == 0 and "refused" in g.cases[0].got  # its own namespace's loopback


@needs_ns
def test_writes_land_in_a_private_dir_that_is_gone_after():
    src = "import os\ndef f():\n    open('x', 'w').write('y')\n    return os.listdir('.')\n"
    g = grade_with(src, [{"call": "f()", "expected": ["x"]}] * 2, LIMITS)
    assert g.reward == 1.0  # and each case starts from an empty dir
    assert leftovers("none", g.run_id) == []


# ---- sandbox.isolation=none ----------------------------------------------------------------
# Run as a sandbox uid, with RLIMIT_NPROC, a subreaper harness and process-tree kills, but no
# private /tmp, network or /proc and no seccomp filter: write_outside, sockets, read_host and
# the programs of tests/test_hostile_memory.py are not contained there (docs/sandbox.md).
# kill_parent is left out because nothing but the uid stops it.
FALLBACK = ["sleep_forever", "fork_bomb", "thread_bomb", "memory_hog", "fork_memory_hog",
            "huge_file", "detached_daemon", "exit_early", "forge_channel", "always_equal",
            "syntax_error"]  # fmt: skip
WORLD_READABLE_PYTHON = "/usr/bin/python3"


def _fallback_limits() -> SandboxSettings:
    s = SandboxSettings.defaults(timeout_s=1.0, isolation="none", python=WORLD_READABLE_PYTHON)
    if not os.path.exists(WORLD_READABLE_PYTHON) or detect("none", s.python).refusal:
        pytest.skip(f"no interpreter a sandbox uid can import from at {WORLD_READABLE_PYTHON}")
    return s


@pytest.mark.parametrize("name", [_param(n) for n in FALLBACK])
def test_hostile_without_namespaces(name):
    limits = _fallback_limits()
    tag = new_tag()
    g = grade_with(program(name, tag), CASES, limits)
    c = check(name, g, tag, limits.timeout_s)
    assert c.contained, (c.reasons, g)
    assert g.isolation == "none"
    assert grade_with(CORRECT, CASES, limits).reward == 1.0
    if name == "detached_daemon":
        time.sleep(DAEMON_WAKE_S)
        assert leftovers(tag, g.run_id) == []


def test_refuses_root_without_namespaces_or_a_readable_stdlib():
    iso = detect("none")
    if not iso.refusal:
        pytest.skip("this interpreter's stdlib is readable by a sandbox uid, or not root")
    with pytest.raises(SandboxUnavailable, match="sandbox.python"):
        grade_with(CORRECT, CASES, SandboxSettings.defaults(isolation="none"))
