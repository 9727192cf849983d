"""verifiers environments for tests/test_verifiers_env.py (datasets built in code, no
downloads). Each ``*_env()`` is what ``env.id=tests.vf_envs.<name>`` loads."""

from __future__ import annotations

import asyncio

import verifiers as vf
from datasets import Dataset

PAIRS = [(a, b) for a in range(1, 5) for b in range(1, 5)]


def _rows() -> Dataset:
    return Dataset.from_list([{"question": f"{a}+{b}=", "answer": str(a + b)} for a, b in PAIRS])


def _text(completion) -> str:
    last = completion[-1]
    content = last.get("content") if isinstance(last, dict) else last.content
    return str(content or "")


def correct(completion, answer, **kwargs) -> float:
    """1 if the last assistant message ends with the sum."""
    return float(_text(completion).strip().endswith(answer))


def single_env() -> vf.Environment:
    return vf.SingleTurnEnv(dataset=_rows(), rubric=vf.Rubric(funcs=[correct]))


def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b


def tool_env() -> vf.Environment:
    return vf.ToolEnv(dataset=_rows(), tools=[add], max_turns=3, rubric=vf.Rubric(funcs=[correct]))


class RaisingEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        raise ValueError("the env broke")


class HangingEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        await asyncio.sleep(3600)


class GarbageEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return 42


def raising_env() -> vf.Environment:
    return RaisingEnv(dataset=_rows(), max_turns=3, rubric=vf.Rubric(funcs=[correct]))


def hanging_env() -> vf.Environment:
    return HangingEnv(dataset=_rows(), max_turns=3, rubric=vf.Rubric(funcs=[correct]))


def garbage_env() -> vf.Environment:
    return GarbageEnv(dataset=_rows(), max_turns=3, rubric=vf.Rubric(funcs=[correct]))


def exact(completion, answer, **kwargs) -> float:
    """1 if the answer is exactly the sum (the tiny model answers bare)."""
    return float(_text(completion).strip() == answer)


def addition_env() -> vf.Environment:
    """The default task's problems (``a+b=``, operands 0..19) as a verifiers env, for the
    tiny model warm-started on them (tests/test_verifiers_env.py's CLI run)."""
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a in range(20) for b in range(20)]
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[exact]))
