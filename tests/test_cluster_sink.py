"""The cluster pieces on one node: which runtime_env the driver asks for
(``ray.ship_code``), and a learner rank that believes it is on another node than the
driver's (the one fake: ``remote_sink`` answers with the driver's sink, the node
boundary) saving, loading and logging through the real FileSink actor."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import build_tiny_qwen, plain_optim, refused_before_ray, trajs

from asyncrl.cluster.ship import EXCLUDES, ShipCode, code_runtime_env, package_dir

ENV = {"TOKENIZERS_PARALLELISM": "false"}
CONF = Path(__file__).parents[1] / "conf"

BAD = [
    ("ray.ship_code=sometimes", "ray.ship_code='sometimes': expected one of"),
    ("learner.resources=3", "learner.resources=3: expected a dict"),
    ("learner.resources={node_b: 0}", "learner.resources.node_b=0: expected a number > 0"),
    ("learner.resources={CPU: 1}", "learner.resources: 'CPU' is not a custom resource"),
    ("learner.resources={node_b: 1}", "a local Ray (ray.address=null) has no custom resources"),
]


@pytest.mark.parametrize("override,names", BAD, ids=[o for o, _ in BAD])
def test_bad_cluster_keys_stop_the_run_before_ray(override, names, tmp_path, capsys, monkeypatch):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose("config", overrides=[override, "progress=false"])
    line = refused_before_ray(cfg, tmp_path, capsys, monkeypatch)
    assert names in line, line


def test_local_ray_keeps_the_driver_paths(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for ship in (ShipCode.AUTO, ShipCode.NEVER):
        env = code_runtime_env(ship, joined=False, env_vars=ENV)
        assert set(env) == {"env_vars"}  # nothing uploaded: start-up as before
        assert env["env_vars"]["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path)
    never = code_runtime_env(ShipCode.NEVER, joined=True, env_vars=ENV)
    assert set(never) == {"env_vars"} and "PYTHONPATH" in never["env_vars"]


def test_a_cluster_gets_the_code_shipped(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for ship, joined in ((ShipCode.AUTO, True), (ShipCode.ALWAYS, False)):
        env = code_runtime_env(ship, joined=joined, env_vars=ENV)
        assert "PYTHONPATH" not in env["env_vars"]  # no path of the driver's machine
        assert env["py_modules"] == [str(package_dir())]
        assert env["working_dir"] == str(tmp_path.resolve())
        assert set(EXCLUDES) <= set(env["excludes"]) and ".?*" in env["excludes"]
        assert env["env_vars"]["ASYNCRL_SHIPPED"] == "1"  # conf/ from the working dir
    # from a checkout, asyncrl/ ships once: as the py_module, not again in the working dir
    monkeypatch.chdir(package_dir().parent)
    env = code_runtime_env(ShipCode.AUTO, joined=True, env_vars=ENV)
    assert f"/{package_dir().name}" in env["excludes"]


def test_shipping_leaves_out_dotfiles_and_key_material():
    """The excludes as Ray applies them (its own gitwildmatch PathSpec)."""
    from ray._private.thirdparty.pathspec import PathSpec

    spec = PathSpec.from_lines("gitwildmatch", EXCLUDES)
    assert not spec.match_file(".")  # Ray asks about the working dir itself too
    left_out = [".ssh/id_rsa", ".env", ".git/config", ".venv/bin/python", "keys/server.pem",
                "deploy/id_ed25519.pub", "aws/credentials", "outputs/run/summary.json",
                "sub/.netrc", "tls.key"]  # fmt: skip
    shipped = ["my_loss.py", "conf/config.yaml", "pkg/tasks/env.py", "README.md"]
    assert [p for p in left_out if not spec.match_file(p)] == []
    assert [p for p in shipped if spec.match_file(p)] == []


@pytest.mark.parametrize("where", ["home", "root"])
def test_a_home_directory_or_the_root_is_never_shipped(monkeypatch, tmp_path, where):
    from asyncrl.config import ConfigError

    if where == "home":
        monkeypatch.setenv("HOME", str(tmp_path))
        monkeypatch.chdir(tmp_path)
    else:
        monkeypatch.chdir("/")
    with pytest.raises(ConfigError, match="ray.ship_code: the working directory .* is a home"):
        code_runtime_env(ShipCode.ALWAYS, joined=True, env_vars=ENV)
    code_runtime_env(ShipCode.NEVER, joined=True, env_vars=ENV)  # nothing shipped: fine


def test_a_shipped_worker_reads_the_working_dirs_conf(monkeypatch, tmp_path):
    from asyncrl import confdir

    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text("seed: 0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(confdir, "_PACKAGED", tmp_path / "none")
    monkeypatch.setattr(confdir, "_CHECKOUT", tmp_path / "none")
    monkeypatch.setenv("ASYNCRL_SHIPPED", "1")
    assert confdir.conf_dir() == tmp_path / "conf"
    monkeypatch.delenv("ASYNCRL_SHIPPED")
    with pytest.raises(FileNotFoundError, match="reinstall asyncrl"):
        confdir.conf_dir()


@pytest.fixture
def sink(ray_local, tmp_path):
    from asyncrl.storage import sink as sink_mod

    handle = sink_mod.start_sink()
    sink_mod.allow_run_dir(tmp_path / "run")
    yield handle
    ray_local.kill(handle)
    sink_mod.forget_sink()


def test_remote_rank_saves_loads_and_logs_through_the_sink(sink, tmp_path, monkeypatch):
    import ray

    from asyncrl.learner import checkpoint as ck
    from asyncrl.learner import layout
    from asyncrl.learner.batch import collate
    from asyncrl.learner.config import LearnerSettings
    from asyncrl.learner.learner import Learner
    from asyncrl.losses.advantages import GroupNormalized
    from asyncrl.losses.clipped import ClippedISLoss
    from asyncrl.utils.runlog import TrajectoryLog, read_trajectories

    monkeypatch.setattr(ck, "remote_sink", lambda: sink)
    monkeypatch.setattr("asyncrl.utils.runlog.remote_sink", lambda: sink)
    model = build_tiny_qwen(tmp_path / "m")
    torch.set_num_threads(1)

    def make() -> Learner:
        s = LearnerSettings.defaults(optim=plain_optim(lr=1e-2), micro_batch_tokens=40)
        return Learner(str(model), ClippedISLoss(), GroupNormalized(), s, seed=1)

    run = tmp_path / "run"
    L = make()
    L.step_on_batch(collate(trajs(8, seed=3)), 0)
    L.version = 1
    L.save(str(layout.step_dir(run, 1)), driver_state={"v": 1})
    layout.publish(run, 1, keep=2)
    meta = layout.verify(layout.find_latest(run), full=True)  # sealed at the sink's side
    assert meta["version"] == 1 and not (run / "checkpoints" / "step-1.tmp").exists()
    recs = [json.loads(x) for x in (run / "cluster_sink.jsonl").read_text().splitlines()]
    sent = {r["path"] for r in recs}
    assert "checkpoints/step-1.tmp/learner.json" in sent
    assert "checkpoints/step-1.tmp/rng/rank0.safetensors" in sent
    assert not any(p.endswith("manifest.json") for p in sent)  # written at the driver's side

    L2 = make()  # loads from bytes fetched through the sink: the same weights
    got = L2.load(str(layout.find_latest(run)))
    assert got["version"] == 1 and got["driver_state"] == {"v": 1}
    for (n, a), (_, b) in zip(L.policy.state_dict().items(), L2.policy.state_dict().items()):
        assert torch.equal(a, b), n

    log = TrajectoryLog({"dir": str(run / "trajectories"), "part_every": 1})
    batch = trajs(4, seed=5)
    log.write(0, batch, learner_version=1)
    log.write(1, batch, learner_version=2)
    log.close()
    assert not log._stage.exists()  # nothing left on the rank's node
    table = read_trajectories(run)
    assert table.num_rows == 8 and sorted(set(table.column("step").to_pylist())) == [0, 1]
    assert len((run / "trajectories" / "batches.jsonl").read_text().splitlines()) == 2

    with pytest.raises(ray.exceptions.RayTaskError, match="outside the run directories"):
        ray.get(sink.put.remote(str(tmp_path / "elsewhere.bin"), 0, b"x", True, "n"))
    assert not Path(tmp_path / "elsewhere.bin").exists()


def test_the_sink_serves_only_files_inside_its_run_directories(sink, tmp_path):
    """Reads name a tree inside a run directory and a relative path inside that tree:
    no absolute path, no ``..``, no symlink leading out, no other folder."""
    import ray

    ck = tmp_path / "run" / "ck"
    ck.mkdir(parents=True)
    (ck / "a.bin").write_bytes(b"abc")
    secret = tmp_path / "secret.txt"
    secret.write_text("key material")
    assert ray.get(sink.get.remote(str(ck), "a.bin", 0, 10)) == b"abc"
    assert ray.get(sink.list_files.remote(str(ck), [])) == [("a.bin", 3)]
    assert ray.get(sink.count.remote(str(ck), "*.bin")) == 1
    refused = {
        "absolute file": sink.get.remote(str(ck), str(secret), 0, 10),
        "dot-dot file": sink.get.remote(str(ck), "../../secret.txt", 0, 10),
        "root outside": sink.get.remote(str(tmp_path), "secret.txt", 0, 10),
        "dot-dot root": sink.get.remote(f"{ck}/../..", "secret.txt", 0, 10),
        "relative root": sink.get.remote("run/ck", "a.bin", 0, 10),
        "list outside": sink.list_files.remote("/etc", []),
        "count outside": sink.count.remote("/etc", "*"),
        "count pattern": sink.count.remote(str(ck), "../../*"),
    }
    for what, ref in refused.items():
        with pytest.raises(PermissionError, match="file sink"):
            ray.get(ref)
            pytest.fail(what)
    assert "outside the run directories" in ray.get(sink.verify.remote(str(tmp_path)))
    (ck / "out").symlink_to(secret)  # a symlink leading out of the tree
    for ref in (sink.get.remote(str(ck), "out", 0, 10), sink.list_files.remote(str(ck), [])):
        with pytest.raises(PermissionError, match="leads out of"):
            ray.get(ref)
