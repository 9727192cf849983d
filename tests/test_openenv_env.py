"""env=openenv: OpenEnv servers (tests/openenv_arith.py, written with openenv-core's own
API) run as local processes on loopback, episodes round-trip through openenv's client,
and a server that crashes, hangs or answers garbage costs one episode (env_error) and is
started again; no server outlives the process that started it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("openenv.core")

from fake_engine import FakeEngine  # noqa: E402

from asyncrl.actor.env_runner import MultiTurnEpisodes  # noqa: E402
from asyncrl.actor.settings import ActorSettings  # noqa: E402
from asyncrl.config import ConfigError  # noqa: E402
from asyncrl.engine.settings import EngineSettings, SamplingSettings  # noqa: E402
from asyncrl.envs.openenv_env import OpenEnvEnv, OpenEnvTask  # noqa: E402
from asyncrl.envs.openenv_server import OpenEnvServerError, ServerPool  # noqa: E402
from asyncrl.envs.settings import EnvSettings  # noqa: E402
from asyncrl.models.tiny import build_tokenizer  # noqa: E402
from asyncrl.tasks.base import Prompt  # noqa: E402

ROOT = Path(__file__).parents[1]
KW = {
    "server": "openenv_arith",
    "servers": 1,
    "sessions_per_server": 8,
    "action_key": "message",
    "observation_key": "prompt",
    "start_timeout_s": 120,
    "step_timeout_s": 4,
}


def seed(s: int) -> Prompt:
    return Prompt("", meta={"seed": s})


def solve(prompt: str) -> str:
    a, b = prompt.rstrip("=").split("+")
    return str(int(a) + int(b))


def gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} spell them) listening on ``port``."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            addr, p = f[1].split(":")
            if int(p, 16) == port and f[3] == "0A":
                out.append(addr)
    return out


@pytest.fixture
def pool():
    p = ServerPool(OpenEnvEnv(**KW).settings)
    yield p
    p.close()


def env_of(pool: ServerPool, **kw) -> OpenEnvEnv:
    return OpenEnvEnv(pool=pool, **{**KW, **kw})


def test_server_on_loopback_round_trips_and_stops(pool):
    async def go():
        envs = [env_of(pool) for _ in range(3)]
        first = await asyncio.gather(*(e.reset(seed(7), None) for e in envs))
        assert len(set(first)) == 1 and first[0].endswith("=")  # one seed, one prompt
        wrong = await envs[0].step("0" if solve(first[0]) != "0" else "1", [])
        assert (wrong.observation, wrong.reward, wrong.done) == (first[0], 0.0, False)
        second = await envs[0].step(solve(first[0]), [])
        right = await envs[1].step(solve(first[0]), [])
        assert (second.reward, second.done, right.reward, right.done) == (0.5, True, 1.0, True)
        assert envs[2].lease is not None and pool.servers[0].sessions == 1
        await envs[2].close()
        assert pool.servers[0].sessions == 0
        other = await env_of(pool).reset(seed(8), None)
        return first[0], other

    a, b = asyncio.run(go())
    assert a != b or a == "0+0="  # another seed: (almost surely) another prompt
    server = pool.servers[0]
    assert listening(server.port) == ["0100007F"]  # 127.0.0.1 and nothing else
    pid = server.pid
    assert pool.pids() == [pid]
    pool.close()
    assert gone(pid) and not listening(server.port)


def test_crash_and_hang_are_env_errors_and_the_server_restarts(pool):
    async def go():
        env = env_of(pool)
        await env.reset(seed(1), None)
        pid = pool.pids()[0]
        with pytest.raises(OpenEnvServerError, match="crashed"):
            await env.step("crash", [])
        assert gone(pid)
        prompt = await env.reset(seed(1), None)  # the next episode: a new server
        assert pool.restarts == 1 and pool.pids() != [pid]
        assert (await env.step(solve(prompt), [])).reward == 1.0
        await env.reset(seed(2), None)
        hung = pool.pids()[0]
        t = time.monotonic()
        with pytest.raises(OpenEnvServerError, match="hung"):
            await env.step("hang", [])
        assert time.monotonic() - t < KW["step_timeout_s"] + 10
        assert gone(hung)
        prompt = await env.reset(seed(2), None)
        assert pool.restarts == 2 and (await env.step(solve(prompt), [])).reward == 1.0

    asyncio.run(go())


def test_garbage_is_an_env_error_and_the_server_stays(tmp_path):
    async def go(pool):
        env = env_of(pool, server="openenv_arith:garbage_app")
        assert await env.reset(seed(1), None) == "1+1="
        with pytest.raises(OpenEnvServerError, match="step.*JSON|step.*Expecting"):
            await env.step("2", [])
        assert await env.reset(seed(1), None) == "1+1="  # the same server, still healthy
        assert pool.restarts == 0
        missing = env_of(pool, server="openenv_arith:garbage_app", observation_key="text")
        with pytest.raises(OpenEnvServerError, match="observation_key=text"):
            await missing.reset(seed(1), None)
        await missing.close()

    p = ServerPool(OpenEnvEnv(**{**KW, "server": "openenv_arith:garbage_app"}).settings)
    try:
        asyncio.run(go(p))
    finally:
        p.close()


class ScriptedEngine(FakeEngine):
    """Answers each request with ``policy(prompt text)`` then EOS (the engine seam's
    fake, tests/fake_engine.py)."""

    def __init__(self, policy, tok):
        text = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
        super().__init__(tok, lambda ids: policy(text(ids)), logprob=-0.5)
        self.text = text

    @property
    def prompts(self) -> list[str]:
        return [self.text(ids) for ids in self.requests]


def test_runner_prompts_with_the_observation_and_scores_a_crash_env_error(pool):
    """The reset's observation is the prompt (never trained); a crash mid-episode is that
    episode's ``finish_reason="env_error"``, and the next group runs on a new server."""
    tok = build_tokenizer("0123456789+=crash")

    def odd(text: str) -> bool:
        return int(text.split("+")[0]) % 2 == 1

    def policy(text: str) -> str:
        return "crash" if odd(text) else solve(text)

    env = EnvSettings.from_config({"_target_": "asyncrl.envs.openenv_env.OpenEnvEnv", **KW})
    env.make = lambda: env_of(pool)  # this test's pool (the actor's: shared_pool)
    settings = ActorSettings.defaults(
        sampling=SamplingSettings.defaults(n=2, max_tokens=8),
        engine=EngineSettings.defaults(max_model_len=64),
    )
    engine = ScriptedEngine(policy, tok)
    runner = MultiTurnEpisodes(engine, OpenEnvTask(), settings, env, lambda: 0)

    async def go():
        seeds = (0, 2, 1)  # first operands 12, 1 (the policy crashes the server), 4
        return [await runner.run_group(Prompt("", meta={"seed": s})) for s in seeds]

    groups = asyncio.run(go())
    trajs = [t for g in groups for t in g.trajectories]
    fine = [t for t in trajs if t.finish_reason == "done"]
    crashed = [t for t in trajs if t.finish_reason == "env_error"]
    assert len(fine) + len(crashed) == len(trajs) and crashed and len(fine) >= 2
    for t in fine:
        assert t.reward == 1.0 and not t.error and not odd(t.prompt_text)
        assert tok.decode(t.prompt_ids, skip_special_tokens=True) == t.prompt_text
        assert t.loss_mask.all() and t.episode["turns"] == 1
    for t in crashed:  # the crashing episode, or a sibling whose reset met the dead server
        assert t.reward == 0.0 and "OpenEnvServerError" in t.error
        assert t.prompt_text == "" or odd(t.prompt_text)
    assert pool.restarts >= 1 and all(s.sessions == 0 for s in pool.servers)


def test_settings_are_checked_with_the_key():
    for bad, key in [
        ({"server": ""}, "env.server"),
        ({"server": "no_such_module_x"}, "env.server"),
        ({"servers": 0}, "env.servers"),
        ({"step_timeout_s": -1}, "env.step_timeout_s"),
        ({"action_key": ""}, "env.action_key"),
    ]:
        with pytest.raises(ConfigError, match=key):
            EnvSettings.from_config(
                {"_target_": "asyncrl.envs.openenv_env.OpenEnvEnv", **{**KW, **bad}}
            )
    with pytest.raises(ConfigError, match="env.sessions_per_server"):
        EnvSettings.from_config({"_target_": "asyncrl.envs.openenv_env.OpenEnvEnv", **{
            **KW, "sessions_per_server": "4"}})  # fmt: skip
    with pytest.raises(RuntimeError, match="env=openenv"):
        OpenEnvTask().reward(Prompt(""), "1")


HOLDER = """
import asyncio, sys
from asyncrl.envs.openenv_env import OpenEnvEnv
from asyncrl.tasks.base import Prompt
async def main():
    env = OpenEnvEnv(**{kw})
    await env.reset(Prompt("", meta={{"seed": 1}}), None)
    print(env.pool.pids()[0], flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_no_server_outlives_its_process(sig):
    """The process holding the pool dies (SIGKILL: no atexit, no close): its server goes
    with it (PR_SET_PDEATHSIG)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER.format(kw=json.dumps(KW))],
        stdout=subprocess.PIPE, env=env, text=True,
    )  # fmt: skip
    try:
        server = int(holder.stdout.readline())
        assert not gone(server, 0.5)
        holder.send_signal(sig)
        holder.wait(30)
        assert gone(server)
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_cli_trains_on_an_openenv_server(tmp_path):
    """``env=openenv env.server=tests.openenv_arith`` from the CLI: 5 steps on the shipped
    tiny model (warm-started on this addition), every trajectory accounted, the reward
    logged, and no server left once the run is over."""
    from helpers import run_cli

    out, tag = tmp_path / "run", f"ASYNCRL_TEST_TAG={uuid.uuid4().hex}"
    r = run_cli(
        out, "env=openenv", "env.server=tests.openenv_arith", "env.observation_key=prompt",
        "env.max_turns=2", f"model.path={ROOT / 'asyncrl/models/tiny_default'}",
        "max_steps=5", "learner.batch_groups=4", timeout=1400,
        env={**os.environ, "PYTHONPATH": str(ROOT), "ASYNCRL_TEST_TAG": tag.split("=")[1]},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["steps"] == 5 and s["policy_version"] == 5
    assert s["trajectories_produced"] == (
        s["trajectories_trained"] + s["trajectories_dropped_stale"] + s["trajectories_in_flight"]
    )
    assert s["trajectories_trained"] >= 0.9 * 5 * 4 * 8
    assert 0 < s["reward_mean_first"] < 1 and 0 < s["reward_mean_last"] <= 1
    assert 1 < s["turns_mean"] <= 2  # a wrong first answer gets the prompt back
    pq = pytest.importorskip("pyarrow.parquet")
    parts = sorted((out / "trajectories").glob("part-*.parquet"))
    rows = [
        r for p in parts for r in pq.read_table(p, columns=["prompt", "finish_reason"]).to_pylist()
    ]
    assert {r["finish_reason"] for r in rows} <= {"done", "max_turns", "token_budget"}
    assert all(r["prompt"].endswith("=") and "+" in r["prompt"] for r in rows)
    assert servers_tagged(tag) == []  # every server of the run stopped with it


def servers_tagged(tag: str) -> list[int]:
    """Pids of live OpenEnv server launchers whose environment holds ``tag``."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            if b"PR_SET_PDEATHSIG" in (d / "cmdline").read_bytes() and tag.encode() in (
                d / "environ"
            ).read_bytes().split(b"\0"):
                out.append(int(d.name))
        except OSError:
            continue
    return out
