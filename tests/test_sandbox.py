"""The sandbox's grading contract: exact comparison outside the sandbox, one failing call
fails only its case, settings checked by key, the pool awaited without blocking the event
loop, and the benchmark's JSON. Hostile programs: tests/test_sandbox_hostile.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.config import ConfigError
from asyncrl.sandbox import Grade, SandboxPool, SandboxSettings, grade_python
from asyncrl.sandbox.hostile import CASES, CORRECT
from asyncrl.sandbox.values import BadValue, canon, encode, same

ROOT = Path(__file__).parents[1]


def test_correct_solution_scores_one():
    g = grade_python(CORRECT, CASES)
    assert isinstance(g, Grade)
    assert (g.passed, g.total, g.reward, g.error) == (2, 2, 1.0, "")
    assert [c.got for c in g.cases] == ["3", "42"]


def test_partial_credit_and_one_exception_fails_one_case():
    src = "def add(a, b):\n    if a == 20:\n        raise KeyError('boom')\n    return a + b\n"
    cases = [*CASES, {"call": "add(2, 2)", "expected": 5}]
    g = grade_python(src, cases)
    assert (g.passed, g.total) == (1, 3)
    assert g.reward == pytest.approx(1 / 3)
    assert "KeyError" in g.cases[1].error and g.error.startswith("add(20, 22): KeyError")
    assert g.cases[2].error == "" and g.cases[2].got == "4"  # wrong, but no error


def test_each_case_runs_in_fresh_state():
    src = "seen = []\ndef add(a, b):\n    seen.append(1)\n    return len(seen)\n"
    g = grade_python(src, [{"call": "add(0, 0)", "expected": 1}] * 3)
    assert g.reward == 1.0  # a counter kept across calls would give 1, 2, 3


@pytest.mark.parametrize(
    ("returned", "expected", "ok"),
    [
        ("True", 1, False),  # bool is not int
        ("1", True, False),
        ("1.0", 1, False),  # float is not int
        ("[1, 2]", (1, 2), False),  # list is not tuple
        ("(1, [2.5, None])", (1, [2.5, None]), True),
        ("{'a': (1,), 2: b'x'}", {"a": (1,), 2: b"x"}, True),
        ("{1: 'x'}", {True: "x"}, False),
        ("{1, 2}", frozenset({1, 2}), False),
        ("float('nan')", float("nan"), True),
        ("10**50", 10**50, True),
        ("'3'", 3, False),
        ("{(True, 2)}", {(1, 2)}, False),  # exact inside containers too
        ("{(1.0,): 1}", {(1,): 1}, False),
        ("[-0.0]", [0.0], False),  # signed zero
        ("{0.0: 'a'}", {-0.0: "a"}, False),
        ("{frozenset({1}): [True]}", {frozenset({1}): [True]}, True),
        ("{'b': 2, 'a': 1}", {"a": 1, "b": 2}, True),  # dicts and sets: order does not count
    ],
)
def test_exact_type_and_value(returned, expected, ok):
    g = grade_python(f"def f():\n    return {returned}\n", [{"call": "f()", "expected": expected}])
    assert g.reward == (1.0 if ok else 0.0), g


def test_unsupported_return_types_fail_the_case():
    src = "import fractions\ndef f():\n    return fractions.Fraction(1, 2)\n"
    g = grade_python(src, [{"call": "f()", "expected": 0.5}])
    assert g.reward == 0 and "only plain builtin values" in g.error


def test_malformed_cases_raise():
    for bad in ([], [{"call": 1, "expected": 2}], [{"call": "f()"}], "f()"):
        with pytest.raises(ValueError):
            grade_python(CORRECT, bad)
    with pytest.raises(ValueError, match="plain builtin"):
        grade_python(CORRECT, [{"call": "add(1, 2)", "expected": object()}])


def test_values_round_trip_and_reject_forgeries():
    for v in [None, True, 0, -(10**30), 1.5, float("inf"), "é", b"\x00", [1, (2,)], {1: {2}}]:
        assert canon(json.loads(json.dumps(encode(v)))) == canon(encode(v))
        assert same(v, v)
    dup_key = ["dict", [[["int", "1"], ["int", "1"]], [["int", "1"], ["int", "2"]]]]
    for forged in [True, 3, ["int", 3], ["int", "3x"], ["int", "007"], ["int", "-0"],
                   ["bool", 1], ["object", None], ["list", "abc"], ["dict", [[1]]],
                   ["bytes", "xyz"], ["float", "1e"], dup_key]:  # fmt: skip
        with pytest.raises(BadValue):
            canon(forged)
    # a repeated set member (only a forged tree has one) counts once
    assert canon(["set", [["int", "1"], ["int", "1"]]]) == canon(encode({1}))


def test_colliding_hashes_decode_in_linear_time():
    """Every k * (2**61 - 1) hashes alike: building a set of them is quadratic. The
    grader never builds one; 4x the items takes about 4x the time, not 16x."""

    def tree(n: int) -> list:
        return ["set", [["int", str(k * (2**61 - 1))] for k in range(n)]]

    def seconds(n: int) -> float:
        t, best = tree(n), float("inf")
        for _ in range(3):  # CPU seconds of this thread: other load on the machine does not count
            t0 = time.thread_time()
            canon(t)
            best = min(best, time.thread_time() - t0)
        return best

    small, big = seconds(5000), seconds(20000)
    assert big < 8 * small + 0.01, (small, big)
    assert big < 0.5


def test_output_is_captured_and_the_environment_scrubbed(monkeypatch):
    monkeypatch.setenv("ASYNCRL_FAKE_SECRET", "hunter2")
    src = "import os\nprint('hello')\ndef f():\n    return sorted(os.environ)\n"
    g = grade_python(src, [{"call": "f()", "expected": ["HOME", "LANG", "PATH"]}])
    assert g.reward == 1.0 and g.output.strip() == "hello"


def test_limits_from_arguments():
    g = grade_python(
        "import time\ndef f():\n    time.sleep(5)\n",
        [{"call": "f()", "expected": 1}],
        timeout_s=0.5,
    )
    assert g.reward == 0 and "timeout" in g.error and g.wall_s < 3
    hog = "def f():\n    return len(bytearray(300 << 20))\n"
    assert grade_python(hog, [{"call": "f()", "expected": 300 << 20}]).reward == 1.0
    g = grade_python(hog, [{"call": "f()", "expected": 300 << 20}], memory_mb=128)
    assert g.reward == 0 and "MemoryError" in g.error


def test_settings_from_config_name_the_key():
    s = SandboxSettings.defaults(workers=3, timeout_s=2, memory_mb=256)
    assert (s.workers, s.timeout_s, s.memory_mb) == (3, 2.0, 256)
    for node, key in [
        ({"workers": 0}, "sandbox.workers"),
        ({"timeout_s": -1}, "sandbox.timeout_s"),
        ({"memory_mb": "lots"}, "sandbox.memory_mb"),
        ({"memory_mb": 8}, "sandbox.memory_mb"),
        ({"isolation": "chroot"}, "sandbox.isolation"),
        ({"timeout_s": float("nan")}, "sandbox.timeout_s"),
        ({"timeout_s": 1e10}, "sandbox.timeout_s"),
        ({"memory_mb": 10**12}, "sandbox.memory_mb"),
        ({"open_files": 10**9}, "sandbox.open_files"),
        ({"wokers": 2}, "sandbox"),
    ]:
        with pytest.raises(ConfigError, match=key):
            SandboxSettings.defaults(**node)


async def test_pool_grades_concurrently_without_blocking_the_loop():
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    slow = "import time\ndef add(a, b):\n    time.sleep(0.5)\n    return a + b\n"
    async with SandboxPool(SandboxSettings.defaults(workers=2, timeout_s=5)) as pool:
        task = asyncio.create_task(ticker())
        t0 = time.monotonic()
        grades = await asyncio.gather(*(pool.grade(slow, CASES[:1]) for _ in range(4)))
        took = time.monotonic() - t0
        task.cancel()
        stats = pool.stats()
    assert [g.reward for g in grades] == [1.0] * 4
    assert 0.9 < took < 6.0  # two at a time: two rounds of 0.5 s, not four, not one
    assert ticks > took / 0.01 * 0.3  # the loop kept running while the sandboxes did
    assert stats["sandbox/execs"] == 4 and stats["sandbox/reward_mean"] == 1.0


def test_benchmark_quick_json(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.sandbox", "--out", str(tmp_path), "--quick",
         "--execs", "4", "--rounds", "1", "--hostile", "infinite_loop,exit_early"],
        cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    f = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(f) >= {"execs_per_s", "raw_spawn_per_s", "ratio", "hostile_contained",
                      "hostile_total"}  # fmt: skip
    assert f["execs_per_s"] > 0 and f["raw_spawn_per_s"] > 0
    assert f["ratio"] == pytest.approx(f["execs_per_s"] / f["raw_spawn_per_s"])
    assert f["hostile_contained"] == f["hostile_total"] == 2
    assert (tmp_path / "sandbox.csv").is_file()


def test_frames_without_the_nonce_or_one_record_per_case_are_rejected():
    from asyncrl.sandbox.runner import _parse_frame

    rec = {"payload": '{"ok": true, "value": ["int", "3"]}', "end": "exit 0"}
    good = json.dumps({"nonce": "n", "cases": [rec]}).encode()
    assert _parse_frame(good, "n", 1) == ({"nonce": "n", "cases": [rec]}, "")
    for data, n in [(good, 2), (good + good, 1), (good.replace(b'"n"', b'"m"'), 1), (b"", 1)]:
        frame, error = _parse_frame(data, "n", n)
        assert frame is None and error


def test_no_descriptor_or_temp_dir_leaks():
    import glob
    import tempfile

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    dirs = set(glob.glob(os.path.join(tempfile.gettempdir(), "asyncrl-sandbox-*")))
    before = fds()
    for src in (CORRECT, "import os\nos._exit(3)\n", "print('x' * 10**6)\n"):
        grade_python(src, CASES)
    assert fds() == before
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "asyncrl-sandbox-*"))) <= dirs


def test_seccomp_program_is_well_formed_for_each_machine():
    import struct

    from asyncrl.sandbox import seccomp

    for machine in seccomp.ARCHES:
        prog = seccomp.program(machine)
        assert len(prog) % 8 == 0 and len(prog) // 8 < 4096  # BPF_MAXINSNS
        insns = [struct.unpack("<HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
        assert insns[-1] == (seccomp.RET, 0, 0, seccomp.RET_ALLOW)
        for i, (code, jt, jf, _) in enumerate(insns):  # every jump lands inside
            if code & 0x07 == 0x05:
                assert i + 1 + max(jt, jf) < len(insns)
