"""env=browser (asyncrl/envs/browser): actions, the web tasks and their grading, and a
real headless Chromium (the slow tests: one pool shared by the module).

The slow tests need Debian's ``chromium`` and the ``playwright`` package (scripts/setup.sh
installs both); they skip without them.
"""

from __future__ import annotations

import asyncio
import html
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from asyncrl.envs.browser.actions import Action, parse_action
from asyncrl.envs.browser.server import TaskServer
from asyncrl.envs.browser.sites import KINDS, demonstrations, make_site
from asyncrl.tasks.base import Prompt

ROOT = Path(__file__).resolve().parents[1]


def _have_browser() -> bool:
    try:
        import playwright  # noqa: F401
    except ImportError:
        return False
    return os.access("/usr/bin/chromium", os.X_OK)


needs_browser = pytest.mark.skipif(not _have_browser(), reason="needs chromium and playwright")


# -- without a browser --------------------------------------------------------------


def test_parse_action():
    assert parse_action(" click(3) ") == Action("click", target=3)
    assert parse_action('type(2, "a \\"b\\"")') == Action("type", target=2, text='a "b"')
    assert parse_action('select(1,"green")') == Action("select", target=1, text="green")
    assert parse_action('press("Enter")') == Action("press", text="Enter")
    assert parse_action("scroll(-200)") == Action("scroll", dy=-200)
    for bad in ("click(x)", "click 3", "type(1, ada)", "open(1)", "", 'press("rm -rf")'):
        assert isinstance(parse_action(bad), str), bad


def _post(server: TaskServer, token: str, page: str, fields: dict[str, str]) -> int:
    req = urllib.request.Request(
        f"http://127.0.0.1:{server.port}/s/{token}/submit/{page}",
        data=urllib.parse.urlencode(fields).encode(),
        method="POST",
    )
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        return opener.open(req, timeout=10).status
    except urllib.error.HTTPError as e:
        return e.code


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_server_grades_what_it_received(kind):
    """The goal's fields posted from the goal's page grade 1; the same fields from
    another page, or with one value changed, grade 0 (what the server received, only)."""
    from asyncrl.envs.browser.sites import grade

    site = make_site(kind, random.Random(7))
    server = TaskServer()
    try:
        goal = site["goal"]
        server.add("t1", site)
        for gate_page, gate in site["gates"].items():  # pass the gates first
            assert _post(server, "t1", gate_page, gate) == 303
        assert _post(server, "t1", goal["page"], goal["fields"]) == 200
        assert grade(site, server.final("t1")) == 1.0
        wrong = {k: v + "x" for k, v in goal["fields"].items()}
        server.add("t2", site)
        for gate_page, gate in site["gates"].items():
            _post(server, "t2", gate_page, gate)
        _post(server, "t2", goal["page"], wrong)
        assert grade(site, server.final("t2")) == 0.0
        assert server.final("unknown") is None
    finally:
        server.close()


def _hang_up_mid_request(port: int) -> None:
    """A client that sends half a request line and resets the connection (SO_LINGER 0):
    the server's read of the request fails with ConnectionResetError."""
    import struct

    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"GET /s/x")
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def test_a_client_hanging_up_is_not_a_server_fault(capfd):
    """A browser context closed mid-request is an episode ending: the stdlib's server
    prints a traceback for it (checked first, so the trigger is real), the task server
    prints nothing and keeps serving."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    plain = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    threading.Thread(target=plain.serve_forever, daemon=True).start()
    try:
        _hang_up_mid_request(plain.server_address[1])
        printed, deadline = "", time.monotonic() + 10
        while "ConnectionResetError" not in printed and time.monotonic() < deadline:
            time.sleep(0.05)
            printed += capfd.readouterr().err
        assert "ConnectionResetError" in printed
    finally:
        plain.shutdown()
        plain.server_close()
    server = TaskServer()
    try:
        _hang_up_mid_request(server.port)
        time.sleep(1.0)
        assert capfd.readouterr().err == ""
        server.add("t1", make_site("click_button", random.Random(0)))
        assert urllib.request.urlopen(server.url("t1", "home"), timeout=10).status == 200
    finally:
        server.close()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_demonstrations(kind):
    """A scripted (observation, action) pair per step; the first observation is the
    prompt's tree; the sites differ from seed to seed."""
    from asyncrl.envs.browser.env import BrowserTask

    task = BrowserTask([kind])
    p = task.sample(random.Random(1))
    pairs = demonstrations(p.meta["site"])
    assert [a for _, a in pairs] == p.meta["site"]["solution"]
    assert p.text == f"{p.meta['site']['instruction']}\n{pairs[0][0]}\n"
    segs = task.demonstration(p, random.Random(0))
    assert [t for t, trained in segs if trained] == p.meta["site"]["solution"]
    sites = {str(make_site(kind, random.Random(s))) for s in range(20)}
    assert len(sites) > 1
    with pytest.raises(RuntimeError, match="env=browser"):
        task.reward(p, "click(1)")


def test_config_composes():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=["env=browser"])
    assert cfg.task._target_ == "asyncrl.envs.browser.BrowserTask"
    assert cfg.env._target_ == "asyncrl.envs.browser.BrowserEnv"
    if not _have_browser():
        return
    from asyncrl.config import ConfigError
    from asyncrl.envs.browser.env import BrowserEnv
    from asyncrl.envs.settings import EnvSettings

    env = EnvSettings.from_config(cfg.env)  # builds one env: no browser starts
    assert env.max_turns == 6 and isinstance(env.make(), BrowserEnv)
    with pytest.raises(ConfigError, match="env.browsers"):
        EnvSettings.from_config({**dict(cfg.env), "browsers": 0})


# -- a real Chromium ----------------------------------------------------------------

SETTINGS = dict(browsers=1, contexts_per_browser=2, action_timeout_s=8.0, episode_timeout_s=90.0)


@pytest.fixture(scope="module")
def pool():
    from asyncrl.envs.browser.pool import PoolSettings, shared_pool

    p = shared_pool(PoolSettings(**SETTINGS))
    yield p
    pids = p.browser_pids()
    p.close()
    assert not [pid for pid in pids if _alive(pid)]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _env():
    from asyncrl.envs.browser.env import BrowserEnv

    return BrowserEnv(**SETTINGS)


async def _play(env, prompt: Prompt, actions: list[str]) -> tuple[float, list[str | None]]:
    from asyncrl.envs.browser.env import BrowserTask

    await env.reset(prompt, BrowserTask())
    reward, seen = 0.0, []
    for a in actions:
        step = await env.step(a, [])
        reward += step.reward
        seen.append(step.observation)
        if step.done:
            return reward, seen
    return reward, seen


def _wrong(site) -> list[str]:
    """The solution with every typed text and chosen option wrong, and the first click
    of a one-choice task on another element."""
    out = []
    for a in site["solution"]:
        act = parse_action(a)
        if act.kind == "type":
            out.append(f'type({act.target}, "zz")')
        elif act.kind == "select":
            first = site["goal"]["page"]
            opts = [e for e in site["pages"][first] if e["role"] == "combobox"][0]["options"]
            out.append(f'select({act.target}, "{opts[0]}")')
        elif site["kind"] in ("click_button", "follow_link") and not out:
            out.append(f"click({act.target % len(site['pages']['home']) + 1})")
        else:
            out.append(a)
    return out


@pytest.mark.slow
@needs_browser
async def test_scripted_policy_solves_every_task_and_a_wrong_one_fails(pool):
    from asyncrl.envs.browser.env import BrowserTask

    rng = random.Random(3)
    for kind in sorted(KINDS):
        p = BrowserTask([kind]).sample(rng)
        pairs = demonstrations(p.meta["site"])
        reward, seen = await _play(_env(), p, [a for _, a in pairs])
        assert reward == 1.0, kind
        assert seen[-1] is None  # the final submission ends the episode
        assert seen[:-1] == [f"\n{o}\n" for o, _ in pairs[1:]], kind  # the browser's tree
        reward, _ = await _play(_env(), p, _wrong(p.meta["site"]) + ["click(1)"] * 3)
        assert reward == 0.0, kind


@pytest.mark.slow
@needs_browser
async def test_malformed_action_gets_an_error_and_the_episode_goes_on(pool):
    from asyncrl.envs.browser.env import BrowserTask

    p = BrowserTask(["click_button"]).sample(random.Random(5))
    from asyncrl.envs.browser.env import BrowserEnv

    env = BrowserEnv(**SETTINGS, screenshots=True)
    await env.reset(p, BrowserTask())
    frames = []
    for bad in ("clik(1)", "click(99)", 'press("F13")'):
        step = await env.step(bad, [])
        assert not step.done and step.observation.startswith("\nerror: "), bad
        frames.append(step.frame)
    step = await env.step(p.meta["site"]["solution"][0], [])
    assert step.done and step.reward == 1.0
    assert step.info["action_errors"] == 3.0
    # a PNG after each action the browser ran: click(99) and the solution's click
    assert len(env.screenshots) == 2 and all(b.startswith(b"\x89PNG") for b in env.screenshots)
    # and each step returns its own as StepResult.frame (none where nothing ran)
    assert frames == [None, env.screenshots[0], None] and step.frame == env.screenshots[1]


@pytest.mark.slow
@needs_browser
async def test_killed_browser_and_hung_page_are_env_errors_and_the_next_episode_runs(pool):
    from asyncrl.envs.browser.env import BrowserTask
    from asyncrl.envs.browser.pool import BrowserError

    task = BrowserTask(["fill_form"])
    p = task.sample(random.Random(11))
    env = _env()
    await env.reset(p, task)
    await env.step(p.meta["site"]["solution"][0], [])
    (pid,) = pool.browser_pids()
    os.killpg(pid, signal.SIGKILL)  # the browser crashes mid-episode
    with pytest.raises(BrowserError):
        await env.step(p.meta["site"]["solution"][1], [])
    reward, _ = await _play(_env(), p, p.meta["site"]["solution"])
    assert reward == 1.0 and pool.browser_pids() != [pid]  # relaunched
    env = _env()
    await env.reset(p, task)
    t0 = time.monotonic()
    with pytest.raises(BrowserError, match="hung"):  # a page stuck in a loop
        await pool.run(pool.guard(env.session, env.session.page.evaluate("() => {for(;;){}}")))
    assert time.monotonic() - t0 < SETTINGS["action_timeout_s"] + 10
    reward, _ = await _play(_env(), p, p.meta["site"]["solution"])
    assert reward == 1.0
    env = _env()
    await env.reset(p, task)
    env.session.deadline = 0.0  # as if env.episode_timeout_s had passed: the pool reaps it
    await asyncio.sleep(3)
    with pytest.raises(BrowserError, match="episode_timeout_s"):
        await env.step(p.meta["site"]["solution"][0], [])


@pytest.mark.slow
@needs_browser
async def test_the_browser_reaches_only_its_task_server(pool):
    """Links to another loopback port and to an outside address (TEST-NET-1) are aborted
    by the routing before any connection: the listener sees none, the page stays."""
    from asyncrl.envs.browser.env import BrowserTask
    from asyncrl.envs.browser.sites import link

    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen(8)
    other.setblocking(False)
    urls = [f"http://127.0.0.1:{other.getsockname()[1]}/x", "http://192.0.2.1/x"]
    site = make_site("click_button", random.Random(0))
    site["pages"]["home"] = [link("near", urls[0]), link("far", urls[1])] + site["pages"]["home"]
    env = _env()
    await env.reset(Prompt(text="", meta={"site": site}), BrowserTask())
    for i in (1, 2):
        await env.step(f"click({i})", [])
    context = env.session.context

    async def unrouted(url: str) -> str:
        """The launch flags alone (a context without the routing): loopback only."""
        ctx = await context.browser.new_context()
        try:
            page = await ctx.new_page()
            try:
                await page.goto(url, timeout=5000)
                return page.url
            except Exception as e:  # noqa: BLE001 - the refusal is the outcome
                return str(e)
        finally:
            await ctx.close()

    assert "ERR_PROXY_CONNECTION_FAILED" in await pool.run(unrouted(urls[0]))
    try:
        with pytest.raises(BlockingIOError):
            other.accept()  # nothing connected
    finally:
        other.close()
    for _ in range(300):  # a refusal is recorded as its navigation is aborted: after the
        # click (over 5 s once, on a loaded 2-core host)
        if urls[0] in env.refused and urls[1] in env.refused:
            break
        await asyncio.sleep(0.1)
    assert urls[0] in env.refused and urls[1] in env.refused
    step = await env.step("click(3)", [])  # still on the task's page
    assert step.done


HOLDER = """
import asyncio, random, signal, sys, time
# Ctrl-C raises KeyboardInterrupt even when started from a shell's background job (which
# leaves SIGINT ignored for its children)
signal.signal(signal.SIGINT, signal.default_int_handler)
from asyncrl.envs.browser.env import BrowserEnv, BrowserTask
async def main():
    env = BrowserEnv(contexts_per_browser=1)
    task = BrowserTask(["click_button"])
    await env.reset(task.sample(random.Random(0)), task)
    print(" ".join(map(str, env.pool.browser_pids())), flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""


def _tree_after(sig: int) -> list[int]:
    """Start a process holding a pool with one episode open, send it ``sig``; the pids
    of its tree (Chromium's processes included) still alive 60 s later."""
    from asyncrl.utils.affinity import process_tree

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER)], env=env,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line.strip(), "the holder printed no browser pid"
        tree = process_tree(proc.pid)[1:]
        assert any("chromium" in _cmd(p) for p in tree)
        proc.send_signal(sig)
        proc.wait(60)
        deadline = time.monotonic() + 60  # a loaded machine closes Chromium slowly
        while time.monotonic() < deadline and [p for p in tree if _alive(p)]:
            time.sleep(0.5)
        return [p for p in tree if _alive(p)]
    finally:
        proc.kill()
        proc.wait()


def _cmd(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.slow
@needs_browser
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["sigkill", "sigint"])
def test_no_chromium_outlives_its_holder(sig):
    assert _tree_after(sig) == []


@pytest.mark.slow
@needs_browser
def test_runner_episodes_and_a_browser_killed_mid_run(pool, tmp_path):
    """Through the actor's multi-turn runner (a scripted engine, no vLLM): the scripted
    policy's episodes score 1 with the trees masked out of the loss, and carry the page
    after each turn to the log and the report; a browser killed mid-group scores that
    group's episodes env_error, and the next group scores 1."""
    import string

    from test_envs import ScriptedEngine

    from asyncrl.actor.env_runner import MultiTurnEpisodes
    from asyncrl.actor.settings import ActorSettings
    from asyncrl.envs.browser.env import BrowserTask
    from asyncrl.envs.settings import EnvSettings
    from asyncrl.models.tiny import build_tokenizer

    tok = build_tokenizer(string.printable)
    task = BrowserTask(["fill_form"])
    prompt = task.sample(random.Random(2))
    solution, kill = prompt.meta["site"]["solution"], []

    def policy(ids: list[int]) -> str:
        turn = tok.decode(ids, skip_special_tokens=True).count("[1] ") - 1
        if kill and turn == 1:
            for pid in pool.browser_pids():
                os.killpg(pid, signal.SIGKILL)
        return solution[turn]

    env = EnvSettings.defaults(target="asyncrl.envs.browser.BrowserEnv",
                               kwargs=dict(SETTINGS, screenshots=True),
                               max_turns=6, timeout_s=120)  # fmt: skip
    settings = ActorSettings.defaults(
        sampling={"n": 2, "max_tokens": 32}, engine={"max_model_len": 1024}
    )
    engine = ScriptedEngine(policy, tok=tok)
    run = MultiTurnEpisodes(engine, task, settings, env, lambda: 0)
    group = asyncio.run(run.run_group(prompt))
    for t in group.trajectories:
        assert (t.reward, t.finish_reason, t.reward_breakdown["success"]) == (1.0, "done", 1.0)
        assert t.reward_breakdown[f"task/{prompt.meta['task']}"] == 1.0
        trained = tok.decode(t.response_ids[t.loss_mask].tolist(), skip_special_tokens=True)
        assert trained == "".join(solution)  # the actions only: trees are not trained
        # the page after each turn, for the log and the report (never the model's input)
        assert len(t.frames) == len(solution) and all(f.png[:4] == b"\x89PNG" for f in t.frames)
    _episode_report(group.trajectories, solution, tok, tmp_path)
    kill.append(True)
    group = asyncio.run(run.run_group(prompt))
    assert [t.finish_reason for t in group.trajectories] == ["env_error"] * 2
    assert all(t.reward == 0.0 and "BrowserError" in t.error for t in group.trajectories)
    kill.clear()
    group = asyncio.run(run.run_group(prompt))
    assert [t.reward for t in group.trajectories] == [1.0, 1.0]


def _episode_report(trajs, solution: list[str], tok, out) -> None:
    """The trajectories through the log (each frame once, by key, named per turn) into
    the report: one episode's actions, each beside the page after it."""
    import base64

    from asyncrl.tools.report import write_report
    from asyncrl.trajectory import from_bytes, to_bytes
    from asyncrl.utils.runlog import LogSettings, TrajectoryLog, read_trajectories

    back = from_bytes(to_bytes(trajs))  # as the group travels through the object store
    assert [f.key for f in back[0].frames] == [f.key for f in trajs[0].frames]
    log = TrajectoryLog(LogSettings.defaults().spec(out))
    log.write(1, back, 1)
    log.close()
    rows = read_trajectories(out).to_pylist()
    assert rows[0]["frames"] == [f"images/{f.key}.png" for f in trajs[0].frames]
    page = write_report(out, rows, out / "report.html", lambda i: tok.decode([i])).read_text()
    assert "One episode, step by step" in page
    for action, frame in zip(solution, rows[-1]["frames"]):
        assert html.escape(action) in page
        assert base64.b64encode((out / "trajectories" / frame).read_bytes()).decode() in page


def test_the_saved_tiny_tokenizer_keeps_whitespace_as_vllm_loads_it(tmp_path):
    """transformers loads a saved Qwen2 model's tokenizer as Qwen2Tokenizer (so does
    vLLM): its ids of a browser prompt, spaces and newlines included, are the built
    tokenizer's (what the warm start trained on), and it decodes them back exactly."""
    import string

    from transformers import AutoTokenizer, Qwen2Config

    from asyncrl.envs.browser.env import BrowserTask
    from asyncrl.models.tiny import build_tokenizer

    built = build_tokenizer(string.printable)
    built.save_pretrained(tmp_path)
    Qwen2Config(vocab_size=len(built)).save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    p = BrowserTask().sample(random.Random(1))
    text = p.text + p.answer + " \t\n\n  "
    ids = built(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert loaded(text, add_special_tokens=False)["input_ids"] == ids
    assert loaded.decode(ids) == text == built.decode(ids)


def test_a_cached_tokenizer_naming_whitespace_as_itself_is_resaved(tmp_path):
    """A tiny model cached before whitespace was named byte-level: its tokenizer files
    are re-saved with the same ids, so transformers' loader keeps every space."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

    from asyncrl.envs.browser.env import BrowserTask
    from asyncrl.models.tiny import BOS, EOS, PAD, resave_whitespace_tokenizer

    task = BrowserTask()
    chars = sorted(set(task.alphabet))
    old = Tokenizer(models.WordLevel({t: i for i, t in enumerate([PAD, BOS, EOS, *chars])}, PAD))
    old.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    old.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=old, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                            unk_token=PAD).save_pretrained(tmp_path)  # fmt: skip
    Qwen2Config(vocab_size=len(chars) + 3).save_pretrained(tmp_path)
    text = 'type(1, "ivy")\n[2] textbox'
    assert " " not in AutoTokenizer.from_pretrained(tmp_path).decode(
        AutoTokenizer.from_pretrained(tmp_path)(text, add_special_tokens=False)["input_ids"]
    )  # the old files lose the spaces
    assert resave_whitespace_tokenizer(tmp_path, task) is True
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    ids = loaded(text, add_special_tokens=False)["input_ids"]
    assert ids == [3 + chars.index(c) for c in text] and loaded.decode(ids) == text
    assert resave_whitespace_tokenizer(tmp_path, task) is False  # current: left as it is
