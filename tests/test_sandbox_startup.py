"""``sandbox.isolation`` at start-up, and task=code's grading path: refused with one line
naming the key where the isolation is unavailable (the CLI exits 2 before Ray starts),
a warning for ``none``, and CodeTask never grading on an event loop's thread."""

from __future__ import annotations

import asyncio
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import ConfigError
from asyncrl.envs.code import CodeTask
from asyncrl.sandbox import SandboxSettings, detect
from asyncrl.sandbox.isolation import require, unconfined_warning
from asyncrl.tasks.base import Prompt

ROOT = Path(__file__).resolve().parents[1]
ADD = Prompt("# add(a, b)\n", meta={"cases": [{"call": "add(1, 2)", "expected": 3}]})
needs_bwrap = pytest.mark.skipif(not detect("bwrap").namespaces, reason="no bubblewrap here")


@pytest.fixture
def no_bwrap(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    detect.cache_clear()
    yield
    detect.cache_clear()


def test_unavailable_isolation_is_refused_naming_the_key(no_bwrap):
    with pytest.raises(ConfigError, match=r"^sandbox\.isolation=bwrap: bubblewrap") as e:
        require(SandboxSettings.defaults())
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="sandbox.isolation"):
        CodeTask()


def test_none_warns_and_says_so_for_the_summary():
    assert unconfined_warning(SandboxSettings.defaults()) == ""
    warning = unconfined_warning(SandboxSettings.defaults(isolation="none"))
    assert warning.startswith("sandbox.isolation=none:") and "unconfined" in warning


@needs_bwrap
def test_code_task_grades_through_its_pool_never_on_the_loop():
    task = CodeTask({"workers": 1, "timeout_s": 2.0})
    assert task.reward(ADD, "def add(a, b):\n    return a + b\n")["reward"] == 1.0

    async def on_the_loop() -> dict:
        with pytest.raises(RuntimeError, match="areward"):
            task.reward(ADD, "def add(a, b):\n    return a + b\n")
        return await task.areward(ADD, "def add(a, b):\n    return a - b\n")

    out = asyncio.run(on_the_loop())
    assert out == {"reward": 0.0, "passed": 0.0, "sandbox_error": 0.0}
    copy = pickle.loads(pickle.dumps(task))  # to the actors: settings only, no pool
    assert copy.settings == task.settings and copy._pool is None
    task.pool().close()


@pytest.mark.slow
def test_cli_exits_2_with_one_line_when_isolation_is_unavailable(tmp_path):
    env = dict(os.environ, PATH="/nonexistent", PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, "-m", "asyncrl.train", "task=code", "max_steps=1",
         f"hydra.run.dir={tmp_path}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode == 2, lines[-5:]
    assert len(lines) == 1 and "sandbox.isolation=bwrap" in lines[0], lines
