"""Every component's settings are checked in the driver before Ray starts: a bad value
stops the run with exit 2 and one line naming the key (``asyncrl.train.execute``, what
the CLI runs after Hydra composed the config)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import refused_before_ray
from hydra import compose, initialize_config_dir

CONF = Path(__file__).parents[1] / "conf"

# (component, override, what the one line must name)
BAD = [
    ("run", "max_steps=abc", "max_steps='abc': expected an integer"),
    ("run", "max_steps=0", "max_steps=0"),
    ("ray", "ray.num_cpus=0", "ray.num_cpus=0"),
    ("actor", "actor.update_mode=bogus", "actor.update_mode"),
    ("actor", "actor.sampling.n=0", "actor.sampling.n"),
    ("actor", "actor.max_inflight_groups=0", "actor.max_inflight_groups"),
    (
        "replay",
        "replay.policy=bogus",
        "replay.policy='bogus': expected one of ['throttle', 'drop']",
    ),
    ("replay", "replay.max_staleness=-1", "replay.max_staleness=-1"),
    ("learner", "learner.world_size=0", "learner.world_size"),
    ("learner", "learner.normalisation=batch", "learner.normalisation"),
    ("learner", "learner.batch_groups=0", "learner.batch_groups"),
    ("broker", "broker.mode=bogus", "broker.mode"),
    ("broker", "broker.timeout_s=0", "broker.timeout_s"),
    ("loss", "+loss.clip_low=-1", "loss: building"),
    ("task", "task.max_operand=0", "task.max_operand must be >= 1"),
    ("model", "model.tiny.num_heads=8", "model.tiny"),
    ("sandbox", "sandbox.workers=0", "sandbox.workers=0: expected an integer in [1, 256]"),
    ("checkpoint", "checkpoint.keep=-1", "checkpoint.keep=-1: must be an integer >= 0"),
    ("fault", "fault.max_restarts=-1", "fault.max_restarts=-1: expected an integer >= 0"),
]


def test_checkpoint_keep_is_the_learners_keep():
    """``checkpoint.keep`` (issue 25's name) sets ``learner.checkpoint_keep``; unset, the
    learner's own value stands."""
    from asyncrl.wiring import prepare

    assert prepare(cfg("checkpoint.keep=5")).learner.checkpoint_keep == 5
    assert prepare(cfg()).learner.checkpoint_keep == 2


def cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize("component,override,names", BAD, ids=[f"{c}:{o}" for c, o, _ in BAD])
def test_a_bad_value_stops_the_run_before_ray(
    component, override, names, tmp_path, capsys, monkeypatch
):
    line = refused_before_ray(cfg(override, "progress=false"), tmp_path, capsys, monkeypatch)
    assert names in line, line


def test_every_component_has_a_bad_value_case():
    assert {c for c, _, _ in BAD} >= {
        "run", "ray", "actor", "replay", "learner", "broker", "loss", "task", "model"
    }  # fmt: skip


def _refused(overrides: list[str], tmp_path: Path, capsys, monkeypatch) -> str:
    """The one line ``execute`` prints for ``overrides``; fails if Ray was started."""
    return refused_before_ray(cfg(*overrides, "progress=false"), tmp_path, capsys, monkeypatch)


def test_more_ranks_than_the_machine_has_cpus_is_refused_before_ray(tmp_path, capsys, monkeypatch):
    """Issue 25: learner.world_size=3 on 2 cores was refused only after Ray started."""
    from ray._private.utils import get_num_cpus

    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path / "cache"))  # the tiny model installed
    # as from the command line: no Ray yet (the suite's session Ray may be up in this process)
    monkeypatch.setattr("ray.is_initialized", lambda: False)
    cpus = get_num_cpus()  # one rank per CPU plus the actor's: one CPU too many
    line = _refused([f"learner.world_size={cpus}"], tmp_path, capsys, monkeypatch)
    assert (
        f"needs {cpus + 1} Ray CPUs (actors: 1, learner: {cpus}) but this machine has {cpus}"
        in line
    )
    line = _refused(["ray.num_cpus=1"], tmp_path, capsys, monkeypatch)
    assert "but ray.num_cpus=1 has 1" in line
    assert list((tmp_path / "cache").glob("tiny-*"))  # the model was resolved, so locked,
    assert not list((tmp_path / "cache").glob(".tiny-*.lock"))  # and its lock file removed


def test_a_tensor_parallel_degree_the_ranks_or_the_model_cannot_split_is_refused(
    tmp_path, capsys, monkeypatch
):
    """``learner.tp`` must divide ``learner.world_size``, and the model's heads, key/value
    heads and MLP width (the shipped tiny model has two key/value heads)."""
    line = _refused(["learner.tp=3", "learner.world_size=2"], tmp_path, capsys, monkeypatch)
    assert "learner.tp=3 does not divide learner.world_size=2" in line
    model = CONF.parent / "asyncrl/models/tiny_default"
    line = _refused(
        ["learner.tp=4", "learner.world_size=4", f"model.path={model}"], tmp_path, capsys,
        monkeypatch,
    )  # fmt: skip
    assert f"learner.tp=4: model {model} (qwen2) has num_key_value_heads=2, not divisible" in line


def test_an_engine_tensor_parallel_size_the_model_cannot_split_is_refused(
    tmp_path, capsys, monkeypatch
):
    """``actor.engine.tensor_parallel_size`` must split the model's attention heads (the
    shipped tiny model has 4, with 2 key/value heads), and has one key of its own."""
    model = CONF.parent / "asyncrl/models/tiny_default"
    line = _refused(
        ["actor.engine.tensor_parallel_size=3", f"model.path={model}"], tmp_path, capsys,
        monkeypatch,
    )  # fmt: skip
    assert (
        f"actor.engine.tensor_parallel_size=3: model {model} (qwen2) has 4 attention heads, "
        "2 key/value heads (neither divisible by 3 nor dividing it), not divisible by 3" in line
    ), line
    line = _refused(["+actor.engine.extra.tensor_parallel_size=2"], tmp_path, capsys, monkeypatch)
    assert "actor.engine.extra.tensor_parallel_size: set actor.engine.tensor_parallel_size" in line


def test_vllms_update_api_is_refused_where_it_cannot_serve(tmp_path, capsys, monkeypatch):
    """``broker.engine_api=vllm`` takes whole models (``broker.mode=full``), every worker
    the whole of them (no resharding to a TP engine), and sets the engines' own
    ``weight_transfer_config``; the default road is asyncrl's and sets nothing."""
    from asyncrl.engine.settings import TRANSFER_BACKEND
    from asyncrl.wiring import prepare

    line = _refused(["broker.engine_api=vllm"], tmp_path, capsys, monkeypatch)
    assert (
        "broker.engine_api='vllm': vLLM's weight-update API takes whole models; "
        "broker.mode=sparse_delta stays on asyncrl's" in line
    ), line
    line = _refused(["broker.engine_api=bogus"], tmp_path, capsys, monkeypatch)
    assert "broker.engine_api='bogus': expected one of ('asyncrl', 'vllm')" in line
    model = CONF.parent / "asyncrl/models/tiny_default"
    tp2 = ["actor.engine.tensor_parallel_size=2", f"model.path={model}"]
    vllm = ["broker.engine_api=vllm", "broker.mode=full"]
    line = _refused([*vllm, *tp2], tmp_path, capsys, monkeypatch)
    assert "broker.engine_api=vllm with broker.reshard=true and actor.engine." in line, line
    line = _refused(
        [*vllm, "+actor.engine.extra.weight_transfer_config.backend=nccl"], tmp_path, capsys,
        monkeypatch,
    )  # fmt: skip
    assert "actor.engine.extra.weight_transfer_config={'backend': 'nccl'}" in line, line
    wanted = {"backend": TRANSFER_BACKEND}
    assert prepare(cfg(*vllm)).actor.engine.extra["weight_transfer_config"] == wanted
    assert (
        prepare(cfg(*vllm, *tp2, "broker.reshard=false")).actor.engine.extra[
            "weight_transfer_config"
        ]
        == wanted
    )
    assert "weight_transfer_config" not in prepare(cfg()).actor.engine.extra
    # the object-store broker takes no process-group sync: the key is not its to refuse
    assert prepare(cfg("broker=objectstore", "broker.engine_api=vllm")).broker.mode


def test_a_huge_prompt_is_refused_at_once(tmp_path, capsys, monkeypatch):
    """Issue 25: one 8 MB JSONL line hung start-up in the tiny model's warm start."""
    big = tmp_path / "big.jsonl"
    big.write_text('{"prompt": "1+1=", "answer": "2"}\n' + json.dumps(
        {"prompt": "x" * (8 << 20), "answer": "y"}) + "\n")  # fmt: skip
    line = _refused(["task=jsonl", f"task.path={big}"], tmp_path, capsys, monkeypatch)
    assert "line 2: the prompt is 8388608 characters, more than task.max_prompt_chars=" in line


# The command line itself, for what only it can get wrong (issue 25): Hydra's own
# refusals (an unknown key, an unknown group option) were multi-line exits 1, and
# max_steps=abc a traceback. A harness replaces init_ray with an exit 99, so a row that
# got as far as starting Ray fails loudly; the rest is the real `asyncrl.train.main`.
HARNESS = """
import sys
import asyncrl.train as t
def no_ray(*a, **k):
    print("RAY STARTED", file=sys.stderr)
    sys.exit(99)
t.init_ray = no_ray
sys.argv = ["asyncrl-train", *sys.argv[1:]]
t.main()
"""
CLI_ROWS = {
    "max_steps": ("max_steps=abc", "max_steps='abc': expected an integer"),
    "unknown_key": ("foo=1", "foo: no such key; accepted here: ['actor', "),
    "unknown_option": (
        "loss=nonexistent",
        "loss=nonexistent: no such option in config group 'loss'; accepted: ['cispo', 'clipped', ",
    ),  # fmt: skip
}


@pytest.mark.slow  # a process per row (import time), all at once
def test_the_command_line_refuses_with_one_line_and_exit_2(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(CONF.parent), "ASYNCRL_CACHE": str(tmp_path / "c")}
    procs = {}
    for name, (arg, _) in CLI_ROWS.items():
        cmd = [sys.executable, "-c", HARNESS, arg, f"hydra.run.dir={tmp_path / name}"]
        procs[name] = subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)  # fmt: skip
    for name, p in procs.items():
        _, err = p.communicate(timeout=300)
        lines = err.strip().splitlines()
        assert p.returncode == 2, (name, err[-2000:])
        assert len(lines) == 1 and lines[0].startswith("asyncrl: config error: "), (name, lines)
        assert CLI_ROWS[name][1] in lines[0], (name, lines[0])
