"""Config errors stop the run at start-up with one message naming what to fix."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from helpers import refused_before_ray
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from asyncrl.config import ConfigError, build, check_model_dir, check_ray_address
from asyncrl.wiring import prepare

CONF = Path(__file__).parents[1] / "conf"


def cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("config", overrides=list(overrides))


def test_every_shipped_config_composes():
    groups = {p.parent.name: p.stem for p in CONF.glob("*/*.yaml")}
    for p in CONF.glob("*/*.yaml"):
        c = cfg(
            f"{p.parent.name}={p.stem}"
            if p.parent.name != "experiment"
            else f"+experiment={p.stem}"
        )
        OmegaConf.to_container(c, resolve=True)
    assert {"model", "task", "actor", "learner", "loss", "broker", "replay", "experiment"} <= set(
        groups
    )


@pytest.mark.parametrize("group", ["clipped", "tis", "mis", "decoupled_ppo", "vtrace"])
def test_every_shipped_loss_builds(group):
    loss = build("loss", cfg(f"loss={group}").loss)
    assert callable(loss)


def test_unknown_key_is_refused_by_hydra():
    with pytest.raises(Exception, match="learner.no_such_key"):
        cfg("learner.no_such_key=1")


def test_unknown_target_names_key():
    with pytest.raises(ConfigError, match=r"loss\._target_=.*nope"):
        build("loss", {"_target_": "asyncrl.losses.nope.Missing"})
    with pytest.raises(ConfigError, match="has no 'Missing'"):
        build("loss", {"_target_": "asyncrl.losses.clipped.Missing"})


def test_wrong_argument_names_class_and_accepted():
    with pytest.raises(ConfigError) as e:
        build("loss", {"_target_": "asyncrl.losses.clipped.ClippedISLoss", "alpha": 0.3})
    msg = str(e.value)
    assert "alpha" in msg and "clip_low" in msg and "ClippedISLoss" in msg


def test_bad_argument_value_names_class():
    with pytest.raises(ConfigError, match="ClippedISLoss.*clip_low"):
        build("loss", {"_target_": "asyncrl.losses.clipped.ClippedISLoss", "clip_low": -1})


def test_model_dir_checks(tmp_path):
    with pytest.raises(ConfigError, match="no such directory"):
        check_model_dir(str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="no config.json"):
        check_model_dir(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        check_model_dir(str(tmp_path))
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4})
    )
    with pytest.raises(ConfigError, match="no weights"):
        check_model_dir(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ConfigError, match="no tokenizer"):
        check_model_dir(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match="head_dim 16"):
        check_model_dir(str(tmp_path))


def test_prepare_reports_broken_model_path(tmp_path):
    with pytest.raises(ConfigError, match="model.path="):
        prepare(cfg(f"model.path={tmp_path}"))


def test_more_minibatches_than_trajectories_is_refused():
    with pytest.raises(ConfigError, match=r"learner.minibatches=9 is more than the 8 traj"):
        prepare(cfg("learner.minibatches=9", "learner.batch_groups=2", "actor.sampling.n=4"))
    with pytest.raises(ConfigError, match="learner.minibatches=0: expected an integer >= 1"):
        prepare(cfg("learner.minibatches=0"))


def test_task_with_no_prompts(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="holds no prompts"):
        prepare(cfg("task=jsonl", f"task.path={empty}"))
    with pytest.raises(ConfigError, match="max_operand"):
        prepare(cfg("task.max_operand=0"))


def test_dead_ray_address_fails_fast():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(ConfigError, match=f"ray.address=127.0.0.1:{port}: nothing answers"):
        check_ray_address(f"127.0.0.1:{port}", timeout_s=2)


def test_a_missing_model_path_ends_the_run_with_exit_2(tmp_path, capsys, monkeypatch):
    """What the CLI runs after composing; tests/test_startup_checks.py holds the command
    line's own part (its exit code and its one line)."""
    line = refused_before_ray(cfg(f"model.path={tmp_path}/nope"), tmp_path, capsys, monkeypatch)
    assert "config error: model.path=" in line and "no such directory" in line


def test_delay_mode_is_refused_by_the_training_loop(tmp_path):
    """replay.delay_versions only works with the staleness benchmark's lock-step driver;
    the training loop refuses it before Ray starts instead of waiting for a batch."""
    from asyncrl.train import run

    with pytest.raises(ConfigError, match="replay.delay_versions=2 is the staleness benchmark"):
        run(cfg("replay.delay_versions=2", "replay.max_staleness=2"), tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_the_console_script_finds_its_config_from_any_directory(tmp_path):
    """``asyncrl-train`` (the installed script, not ``python -m`` from the repository
    root) composes the config wherever it is run; --cfg job prints it without running."""
    import subprocess
    import sys

    script = Path(sys.executable).parent / "asyncrl-train"
    if not script.exists():
        pytest.skip("asyncrl-train is not installed in this environment")
    out = subprocess.run(
        [str(script), "--cfg", "job", "actor.engine_cores=0"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "engine_cores: 0" in out.stdout
