"""A real two-node run: a head raylet on 127.0.0.2 and a worker raylet on 127.0.0.3
(token auth on, their own temp dir), the worker started so that ``import asyncrl``
fails in its plain environment (a shadowing ``asyncrl`` first on its PYTHONPATH). The
learner is placed on the worker (``learner.resources``); the code reaches it through
``runtime_env`` (ray.ship_code), a user's loss module in the driver's cwd included,
and its Parquet parts and checkpoint come back to the driver's run directory through
the file sink (asyncrl/storage). docs/cluster.md has the same commands.

Only the processes this module starts are stopped, by pid; never ``ray stop``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[1]
RAY = Path(sys.executable).with_name("ray")
HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"
SHADOW_MESSAGE = "no asyncrl on this node's plain environment"
START_TIMEOUT_S = 120  # a raylet under load (the suite, other runs) can take a while

# The check the worker node must fail first, and the head node pass: a plain task on
# each node (no runtime_env), run from a folder that holds no asyncrl.
PROBE = textwrap.dedent("""
    import json, sys, time
    import ray

    ray.init(address=sys.argv[1], logging_level="ERROR")
    deadline = time.time() + 60
    while len([n for n in ray.nodes() if n["Alive"]]) < 2 and time.time() < deadline:
        time.sleep(0.5)

    def probe():
        try:
            import asyncrl
            return "imported " + asyncrl.__file__
        except ImportError as e:
            return "ImportError: " + str(e)

    out = {}
    for node in ("node_a", "node_b"):
        f = ray.remote(probe).options(num_cpus=0, resources={node: 0.01})
        out[node] = ray.get(f.remote(), timeout=120)
    print(json.dumps(out))
""")

# A user's loss in the driver's cwd: the learner on the worker node unpickles it, so it
# reaches there only through the shipped working_dir.
USER_MODULE = textwrap.dedent("""
    from asyncrl.losses.clipped import ClippedISLoss


    class MyLoss(ClippedISLoss):
        \"\"\"The default loss, from the user's own module.\"\"\"
""")


# A node's graceful stop waits ~30 s on its raylet and GCS; nothing of a test cluster
# needs to be kept, so the stop kills what is left after this.
STOP_GRACE_S = 5


def _can_bind(ip: str) -> bool:
    try:
        with socket.socket() as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


def _free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def _wait_port(ip: str, port: int, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}")
        try:
            with socket.create_connection((ip, port), timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"nothing listens on {ip}:{port} after {timeout_s} s")


def _pids_under(temp_dir: str) -> list[int]:
    """Processes of this cluster: their command line names its temp dir (raylets, GCS,
    agents and workers all carry the session directory)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if temp_dir.encode() in cmd and int(d.name) != os.getpid():
            pids.append(int(d.name))
    return pids


class Cluster:
    def __init__(self, temp_dir: str, shadow: Path):
        self.temp_dir = temp_dir
        self.port = _free_port(HEAD_IP)
        self.address = f"{HEAD_IP}:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "ASYNCRL_RUN"))}
        self.env = dict(
            env, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
            RAY_USAGE_STATS_ENABLED="0",
        )  # fmt: skip
        self.env.pop("PYTHONPATH", None)
        self.procs: list[subprocess.Popen] = []
        self.shadow = shadow

    def _start(self, args: list[str], env: dict[str, str], log: str) -> subprocess.Popen:
        out = open(Path(self.temp_dir) / log, "w")  # noqa: SIM115 (kept open for the process)
        p = subprocess.Popen(
            [str(RAY), "start", "--block", "--disable-usage-stats", *args],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.procs.append(p)
        return p

    def start(self) -> None:
        head = self._start(
            ["--head", f"--node-ip-address={HEAD_IP}", f"--port={self.port}", "--num-cpus=2",
             '--resources={"node_a": 1}', "--include-dashboard=false",
             f"--temp-dir={self.temp_dir}"],
            self.env, "head.log",
        )  # fmt: skip
        _wait_port(HEAD_IP, self.port, START_TIMEOUT_S, head)
        # The worker's processes find a shadowing asyncrl first: plain imports fail there.
        self._start(
            [f"--address={self.address}", f"--node-ip-address={WORKER_IP}", "--num-cpus=1",
             '--resources={"node_b": 1}'],
            dict(self.env, PYTHONPATH=str(self.shadow)), "worker.log",
        )  # fmt: skip

    def stop(self) -> None:
        """SIGTERM to the two ``ray start --block`` process groups, STOP_GRACE_S for them
        to go, then SIGKILL to whatever of this cluster is left; its temp dir removed."""
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        grace = time.time() + STOP_GRACE_S
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, grace - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        deadline = time.time() + 10
        while (left := _pids_under(self.temp_dir)) and time.time() < deadline:
            time.sleep(0.5)
        for pid in _pids_under(self.temp_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.left_at_stop = left
        # `ray start` notes the head's address for `ray.init("auto")`: not ours to leave
        current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        if current.is_file() and self.address in current.read_text():
            current.unlink()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not RAY.is_file():
        pytest.skip(f"no `ray` command beside {sys.executable}")
    if not (_can_bind(HEAD_IP) and _can_bind(WORKER_IP)):
        pytest.skip(f"cannot bind {HEAD_IP} and {WORKER_IP} (loopback is not 127.0.0.0/8 here)")
    shadow = tmp_path_factory.mktemp("shadow")
    (shadow / "asyncrl").mkdir()
    (shadow / "asyncrl" / "__init__.py").write_text(f"raise ImportError({SHADOW_MESSAGE!r})\n")
    # short: Ray's socket paths inside it must stay under the 107-byte limit
    c = Cluster(tempfile.mkdtemp(prefix="arl-mn-", dir="/tmp"), shadow)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def _probe(cluster: Cluster, cwd: Path) -> dict[str, str]:
    (cwd / "probe.py").write_text(PROBE)
    r = subprocess.run(
        [sys.executable, "probe.py", cluster.address], cwd=cwd, env=cluster.env,
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_two_nodes_learner_on_the_worker(cluster, tmp_path, tiny_model):
    project = tmp_path / "project"  # the user's folder: their module, no asyncrl
    project.mkdir()
    # First: the worker node really cannot import asyncrl on its own.
    probe = _probe(cluster, project)
    assert probe["node_b"] == f"ImportError: {SHADOW_MESSAGE}", probe
    assert probe["node_a"].startswith("imported "), probe

    (project / "my_loss.py").write_text(USER_MODULE)
    out = tmp_path / "run"
    steps = 4
    t0 = time.time()
    r = subprocess.run(
        [sys.executable, "-m", "asyncrl.train", f"hydra.run.dir={out}", "progress=false",
         f"ray.address={cluster.address}", "learner.resources={node_b: 0.01}",
         "loss._target_=my_loss.MyLoss", f"max_steps={steps}",
         "learner.batch_groups=4", "learner.checkpoint_every=2"],
        cwd=project, env=cluster.env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-5000:]
    wall = time.time() - t0

    s = json.loads((out / "summary.json").read_text())
    assert s["steps"] == steps and s["policy_version"] == steps
    assert s["trajectories_produced"] == (
        s["trajectories_trained"] + s["trajectories_dropped_stale"] + s["trajectories_in_flight"]
    ), s

    from asyncrl.learner.layout import find_latest, verify
    from asyncrl.utils.runlog import read_trajectories

    t = read_trajectories(out)
    assert t.num_rows == s["trajectories_trained"] > 0
    latest = find_latest(out)
    assert latest.name == f"step-{steps}"
    assert verify(latest, full=True)["version"] == steps

    # What came through the sink: from the worker node to the driver's, parts and every
    # checkpoint file but the manifest (sealed at the driver's side).
    recs = [json.loads(x) for x in (out / "cluster_sink.jsonl").read_text().splitlines()]
    assert recs and all(x["from_node"] != x["to_node"] for x in recs)
    paths = {x["path"] for x in recs}
    assert {p.name for p in (out / "trajectories").glob("part-*.parquet")} <= {
        Path(p).name for p in paths if p.startswith("trajectories/")
    }
    assert f"checkpoints/step-{steps}.tmp/learner.json" in paths
    print(f"two-node run: {steps} steps in {wall:.0f} s, {len(recs)} files through the sink")
