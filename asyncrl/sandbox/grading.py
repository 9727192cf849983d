"""The trusted grader: runs a solution's test calls in the sandbox and compares what
comes back with the expected values, which never leave this process. Everything here
runs in the caller's thread (a SandboxPool thread, never the event loop); reading a
result is linear in its size, which the harness and the channel cap (asyncrl/sandbox/
values.py)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from asyncrl.sandbox.isolation import UIDS, SandboxUnavailable, detect
from asyncrl.sandbox.runner import RawRun, run_harness
from asyncrl.sandbox.settings import SandboxSettings
from asyncrl.sandbox.values import BadValue, canon, encode, is_plain, show

OUTPUT_TAIL = 2000  # characters of the program's output kept on the Grade


@dataclass
class CaseResult:
    call: str
    passed: bool
    got: str  # a short text of the returned value (values.show), or "" when there is none
    error: str  # "" when the call returned a plain value (right or wrong)


@dataclass
class Grade:
    """``reward = passed / total``. ``error`` is empty when every call ran and returned a
    plain value; otherwise it is the first thing that went wrong (a limit, an exception,
    an unsupported return type, a tampered channel)."""

    passed: int
    total: int
    reward: float
    error: str
    cases: list[CaseResult] = field(default_factory=list)
    wall_s: float = 0.0
    output: str = ""  # the tail of stdout+stderr (capped at the source, too)
    isolation: str = ""  # "bwrap" (root), "bwrap-userns" (no root) or "none"
    run_id: str = ""  # in every sandbox process's command line while it runs


def grade_python(
    solution: str, cases: list[dict], *, timeout_s: float = 5.0, memory_mb: int = 512
) -> Grade:
    """Run ``solution`` (Python source) and each case's ``call`` expression in a sandbox;
    a case passes when the call's value has exactly the type and value of its
    ``expected``. Never raises for anything the solution does; raises ValueError for
    malformed ``cases`` and SandboxUnavailable where the machine cannot isolate. Blocks for up to ``timeout_s`` plus a few seconds."""
    limits = SandboxSettings.defaults(timeout_s=timeout_s, memory_mb=memory_mb)
    limits.check()
    return grade_with(solution, cases, limits)


def grade_with(solution: str, cases: list[dict], limits: SandboxSettings) -> Grade:
    """``grade_python`` with every limit from ``limits`` (the pool's path)."""
    calls, expected = check_cases(cases)
    iso = detect(limits.isolation, limits.python)
    if iso.refusal:
        raise SandboxUnavailable(iso.refusal)
    uid = UIDS.take() if iso.drop_uid else None
    try:
        raw = run_harness(solution, calls, limits, iso, uid)
    finally:
        if uid is not None:
            UIDS.give(uid)
    return judge(raw, calls, expected)


def check_cases(cases: list[dict]) -> tuple[list[str], list[str]]:
    if not isinstance(cases, list) or not cases:
        raise ValueError("cases must be a non-empty list of {'call': str, 'expected': value}")
    calls, expected = [], []  # expected: canonical strings (values.canon)
    for i, c in enumerate(cases):
        if not (isinstance(c, dict) and isinstance(c.get("call"), str) and "expected" in c):
            raise ValueError(f"cases[{i}] must be {{'call': str, 'expected': value}}: {c!r}")
        if not is_plain(c["expected"]):
            raise ValueError(f"cases[{i}]['expected'] is not made of plain builtin values")
        calls.append(c["call"])
        expected.append(canon(encode(c["expected"])))
    return calls, expected


def judge(raw: RawRun, calls: list[str], expected: list[str]) -> Grade:
    records = raw.frame["cases"] if raw.frame else [None] * len(calls)
    results = [_judge_case(c, rec, e, raw.error) for c, rec, e in zip(calls, records, expected)]
    passed = sum(r.passed for r in results)
    if raw.error:  # a run-level limit (output cap, deadline) fails every case
        passed = 0
        results = [dataclasses.replace(r, passed=False, error=raw.error) for r in results]
    first = raw.error or next((f"{r.call}: {r.error}" for r in results if r.error), "")
    return Grade(
        passed=passed,
        total=len(calls),
        reward=passed / len(calls),
        error=first,
        cases=results,
        wall_s=raw.wall_s,
        output=raw.output.decode("utf-8", "replace")[-OUTPUT_TAIL:],
        isolation=raw.isolation,
        run_id=raw.run_id,
    )


def _judge_case(call: str, rec: Any, expected: str, run_error: str) -> CaseResult:
    if rec is None:
        return CaseResult(call, False, "", run_error or "no result")
    if not isinstance(rec, dict) or not isinstance(rec.get("end"), str):
        return CaseResult(call, False, "", "malformed case record")
    end, payload = rec["end"][:200], rec.get("payload")
    if not isinstance(payload, str) or not payload:
        return CaseResult(call, False, "", f"no result ({end})")
    try:
        msg = json.loads(payload)
        if not isinstance(msg, dict) or type(msg.get("ok")) is not bool:
            raise BadValue("not a result message")
        if not msg["ok"]:
            return CaseResult(call, False, "", str(msg.get("error", "error"))[:500])
        got = canon(msg.get("value"))
    except (ValueError, RecursionError) as e:  # BadValue and JSONDecodeError are ValueErrors
        return CaseResult(call, False, "", f"unreadable result ({end}): {str(e)[:200]}")
    shown = show(msg["value"])
    if end != "exit 0":
        return CaseResult(call, False, shown, f"case process ended with {end}")
    return CaseResult(call, got == expected, shown, "")
