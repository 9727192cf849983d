"""``env=agent``: a black-box agent program, one subprocess per episode, that talks to
the actor's OpenAI-compatible endpoint (asyncrl/actor/endpoint.py) with any client.

    python <env.program>      environment: OPENAI_BASE_URL  the episode's own base URL
                                           OPENAI_API_KEY   the endpoint's bearer token
                                           ASYNCRL_PROMPT   the task sample's prompt text
      ... its own loop of chat completions (recorded by the endpoint) ...
      last line of stdout:   {"reward": <number>, "info": {"<key>": <number>, ...}}

The reward is the one the program prints as the last non-empty line of its stdout
(``info`` optional: it becomes ``reward/<key>``). A program that exits non-zero, prints
no such line, or outlives ``env.timeout_s`` (then killed) scores 0 with
``finish_reason="env_error"`` and the reason in ``Trajectory.error``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.tasks.base import Prompt

STDERR_TAIL = 400  # characters of a failed program's stderr kept in Trajectory.error


@dataclass
class AgentOutcome:
    """How one agent run ended: its reported reward, or the error (reward 0)."""

    reward: float = 0.0
    info: dict[str, float] = field(default_factory=dict)
    error: str = ""


class AgentProgram:
    """Runs ``program`` (a Python file) with ``python`` (None: this interpreter) per
    episode, with this process's ``sys.path`` as its ``PYTHONPATH``. ``chat_template``: a Jinja chat template, or a path to a file holding one,
    for a model whose tokenizer has none (None: the tokenizer's)."""

    def __init__(
        self, program: str | None, chat_template: str | None = None, python: str | None = None
    ):
        if program is None:
            raise ValueError("env.program: set it to the path of the agent's Python file")
        if not Path(program).is_file():
            raise ValueError(f"env.program={program!r}: no such file")
        self.program = str(Path(program).resolve())
        self.python = python or sys.executable
        if chat_template is not None and Path(chat_template).is_file():
            chat_template = Path(chat_template).read_text()
        self.chat_template = chat_template

    async def run_agent(
        self, base_url: str, api_key: str, sample: Prompt, timeout_s: float
    ) -> AgentOutcome:
        """Run the program once to its end (or ``timeout_s``, then kill it)."""
        env = {
            **os.environ,
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": api_key,
            "ASYNCRL_PROMPT": sample.text,
            # the actor's packages (a Ray worker's interpreter may be the venv's base one,
            # which alone cannot import the venv's `openai`)
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
            "NO_PROXY": "127.0.0.1,localhost",  # the endpoint is on loopback, never a proxy's
            "no_proxy": "127.0.0.1,localhost",
        }
        proc = await asyncio.create_subprocess_exec(
            self.python, self.program, env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return AgentOutcome(error=f"agent program ran past env.timeout_s={timeout_s:g}")
        except asyncio.CancelledError:
            proc.kill()
            raise
        if proc.returncode != 0:
            tail = err.decode(errors="replace")[-STDERR_TAIL:].strip()
            return AgentOutcome(error=f"agent program exited {proc.returncode}: {tail}")
        return parse_report(out.decode(errors="replace"))


def parse_report(stdout: str) -> AgentOutcome:
    """The outcome a program's stdout reports on its last non-empty line."""
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    try:
        obj = json.loads(lines[-1]) if lines else None
        reward = float(obj["reward"])
        info = {str(k): float(v) for k, v in dict(obj.get("info") or {}).items()}
    except (ValueError, TypeError, KeyError, IndexError):
        return AgentOutcome(error='agent program printed no last line {"reward": <number>}')
    if not math.isfinite(reward) or not all(math.isfinite(v) for v in info.values()):
        return AgentOutcome(error=f"agent program reported a non-finite reward: {lines[-1][:80]}")
    return AgentOutcome(reward=reward, info=info)
