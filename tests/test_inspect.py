"""``asyncrl-inspect`` on a short real run's directory: the summary, the four tables,
the filters, one trajectory token by token, and the HTML report with its plots."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[1]
STEPS, EVERY, BATCH_GROUPS = 12, 2, 4


def tool_run(tmp_path_factory) -> Path:
    """One short real run for the tool tests (inspect, replay), made once per session:
    checkpoints kept every EVERY steps, parts every EVERY steps."""
    made = os.environ.get("ASYNCRL_TOOL_RUN")  # a directory this made before (iterating)
    if made and (Path(made) / "summary.json").is_file():
        return Path(made)
    out = tmp_path_factory.getbasetemp() / "tool_run"
    if (out / "summary.json").is_file():
        return out
    r = subprocess.run(
        [sys.executable, "-m", "asyncrl.train", f"hydra.run.dir={out}", "progress=false",
         f"max_steps={STEPS}", f"learner.batch_groups={BATCH_GROUPS}",
         f"learner.checkpoint_every={EVERY}", "++log.keep_checkpoints=true",
         f"++log.part_every={EVERY}"],
        cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True,
        timeout=1500,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model):
    return tool_run(tmp_path_factory)


def inspect(*args: str) -> subprocess.CompletedProcess:
    """``python -m asyncrl.tools.inspect_run`` (what ``asyncrl-inspect`` runs) as a process."""
    return subprocess.run(
        [sys.executable, "-m", "asyncrl.tools.inspect_run", *map(str, args)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def inspect_here(*args) -> subprocess.CompletedProcess:
    """The same tool's ``main`` in this process (its exit code is what ``main`` returns:
    the process above exits with it), without a process's start-up and imports."""
    from asyncrl.tools.inspect_run import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(
        ["asyncrl-inspect", *args], code, out.getvalue(), err.getvalue()
    )


def test_summary_and_tables(run_dir):
    from asyncrl.utils.runlog import read_trajectories

    r = inspect(run_dir, "--top", 3)
    assert r.returncode == 0, r.stderr
    s = json.loads((run_dir / "summary.json").read_text())
    assert (
        f"steps: {STEPS}" in r.stdout
        and f"trajectories_trained: {s['trajectories_trained']}" in r.stdout
    )
    t = read_trajectories(run_dir)
    assert f"{t.num_rows} of {t.num_rows} logged trajectories match" in r.stdout
    for title in (
        "best (highest reward)",
        "worst (lowest reward)",
        "most stale",
        "most mismatched",
    ):
        assert f"== {title}" in r.stdout
    rewards = t.column("reward").to_pylist()
    best, worst = section(r.stdout, "best"), section(r.stdout, "worst")
    assert len(best) == len(worst) == 3
    assert [float(x.split()[2]) for x in best] == pytest.approx(sorted(rewards)[::-1][:3], abs=1e-3)
    assert [float(x.split()[2]) for x in worst] == pytest.approx(sorted(rewards)[:3], abs=1e-3)
    stale = section(r.stdout, "most stale")
    want = sorted(t.column("staleness").to_pylist())[::-1][:3]
    assert [int(x.split()[3]) for x in stale] == want


def section(out: str, title: str) -> list[str]:
    """The data rows of the table titled ``== title ...``."""
    body = out.split(f"== {title}")[1].split("\n== ")[0]
    lines = body.splitlines()[1:]  # the rest of the title line first
    return [ln for ln in lines[2:] if ln.strip()]  # after the header and its rule


def test_filters(run_dir):
    from asyncrl.utils.runlog import read_trajectories

    rows = read_trajectories(run_dir).to_pylist()
    want = [
        x for x in rows if 3 <= x["step"] <= 5 and x["reward"] >= 0.5 and x["response_tokens"] <= 6
    ]
    r = inspect_here(run_dir, "--step", "3:5", "--reward", "0.5:", "--length", ":6", "--top", 1000)
    assert r.returncode == 0, r.stderr
    assert f"{len(want)} of {len(rows)} logged trajectories match" in r.stdout
    steps = [int(ln.split()[0]) for ln in section(r.stdout, "best")]
    assert len(steps) == len(want) and all(3 <= s <= 5 for s in steps)
    bad = inspect_here(run_dir, "--step", "x")
    assert bad.returncode == 2 and "asyncrl-inspect:" in bad.stderr


def test_one_trajectory_token_by_token(run_dir):
    from asyncrl.utils.runlog import read_trajectories

    row = read_trajectories(run_dir).to_pylist()[7]
    r = inspect_here(run_dir, "--traj", row["traj_id"])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert row["traj_id"] in lines[0] and f"step {row['step']}" in lines[0]
    toks = [ln for ln in lines if re.match(r"^\s*\d+ ", ln)]
    assert len(toks) == row["response_tokens"]
    for i, ln in enumerate(toks):  # behaviour, learner, Δ, IS weight, advantage per token
        *_, b, lp, d, w, a = ln.split()
        assert float(b) == pytest.approx(row["behaviour_logprobs"][i], abs=1e-4)
        assert float(lp) == pytest.approx(row["learner_logprobs"][i], abs=1e-4)
        assert float(w) == pytest.approx(row["is_weights"][i], abs=1e-4)
        assert float(a) == pytest.approx(row["advantages"][i], abs=1e-4)
    assert inspect_here(run_dir, "--traj", "nope").returncode == 2


def test_html_report_has_its_plots(run_dir, tmp_path):
    out = tmp_path / "report.html"
    r = inspect_here(run_dir, "--html", out)
    assert r.returncode == 0, r.stderr
    page = out.read_text()
    captions = re.findall(r"<figcaption>([^<]+)</figcaption>", page)
    for c in ("Reward", "Staleness", "IS statistics", "Throughput split", "Broker"):
        assert c in captions, captions
    pngs = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(pngs) == len(captions)
    for b in pngs:  # real PNGs of a real size
        raw = base64.b64decode(b)
        assert raw[:8] == b"\x89PNG\r\n\x1a\n" and len(raw) > 5000
