"""Sandboxed execution of untrusted Python with a trusted grader (docs/sandbox.md).

``grade_python(solution, cases)`` runs once, blocking; ``SandboxPool(settings).grade(...)``
is the awaitable, bounded-concurrency form the environments use."""

from asyncrl.sandbox.grading import CaseResult, Grade, grade_python, grade_with
from asyncrl.sandbox.isolation import SandboxUnavailable, detect, require, unconfined_warning
from asyncrl.sandbox.pool import SandboxPool
from asyncrl.sandbox.settings import SandboxSettings

__all__ = [
    "CaseResult",
    "Grade",
    "SandboxPool",
    "SandboxSettings",
    "SandboxUnavailable",
    "detect",
    "grade_python",
    "grade_with",
    "require",
    "unconfined_warning",
]
