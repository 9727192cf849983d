"""Reproducible by default: the default tiny model is the shipped one (its weights'
sha256 is the recorded value, whatever the machine), a run's fingerprint says what it
ran, and the parts that a seed decides (prompt order, the learner's step on a fixed
batch, the model build) come out the same twice. docs/reproducibility.md."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import build_tiny_qwen, plain_optim, trajs
from omegaconf import OmegaConf

from asyncrl.models import shipped
from asyncrl.models.tiny import LATER_FIELDS, cache_key, default_spec, ensure_tiny_model
from asyncrl.tasks.arithmetic import AdditionTask
from asyncrl.tasks.base import TaskSampler
from asyncrl.utils.fingerprint import (
    config_sha256,
    cpu_model,
    file_sha256,
    fingerprint,
    flat,
    git_state,
    markdown,
    weights_sha256,
)

ROOT = Path(__file__).resolve().parents[1]
# The value the repository records (asyncrl/models/shipped.py), written out here too so
# that a change to the shipped weights has to change a test as well.
RECORDED = "5e17827b5cf57fb3f8449759f3df206c85d4cc73996c9f193fc90688f80a661e"


def default_task():
    """The task of conf/task/addition.yaml, as the training job builds it."""
    from hydra.utils import instantiate

    return instantiate(OmegaConf.load(ROOT / "conf" / "task" / "addition.yaml"))


# ---- the shipped model -----------------------------------------------------------------
def test_shipped_weights_are_the_recorded_ones():
    assert shipped.WEIGHTS_SHA256 == RECORDED
    assert file_sha256(shipped.SHIPPED_DIR / "model.safetensors") == RECORDED
    build = json.loads((shipped.SHIPPED_DIR / "asyncrl_build.json").read_text())
    assert build["weights_sha256"] == RECORDED and build["cache_key"] == shipped.CACHE_KEY
    assert sorted(p.name for p in shipped.SHIPPED_DIR.iterdir()) == sorted(shipped.FILES)


def test_the_default_config_asks_for_the_shipped_model():
    """conf/model/tiny.yaml + conf/task/addition.yaml name the shipped model: a change to
    either must ship a new model (or it would silently be built per machine again)."""
    assert cache_key(default_task(), default_spec()) == shipped.CACHE_KEY
    build = json.loads((shipped.SHIPPED_DIR / "asyncrl_build.json").read_text())
    conf = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "tiny.yaml").tiny)
    # settings added after the model shipped, at their defaults (which build as before)
    assert all(conf.pop(k) == v for k, v in LATER_FIELDS.items())
    assert build["spec"] == conf


def test_default_model_is_copied_not_built(tmp_path):
    path = ensure_tiny_model(default_task(), default_spec(), tmp_path)
    assert path == tmp_path / f"tiny-{shipped.CACHE_KEY}"
    assert weights_sha256(path) == RECORDED
    for name in shipped.FILES:
        assert (path / name).read_bytes() == (shipped.SHIPPED_DIR / name).read_bytes()
    assert ensure_tiny_model(default_task(), default_spec(), tmp_path) == path  # cached


def test_a_machine_built_default_in_the_cache_is_replaced(tmp_path):
    """A cache filled before the model shipped holds this machine's own build."""
    old = tmp_path / f"tiny-{shipped.CACHE_KEY}"
    old.mkdir()
    (old / "config.json").write_text("{}")
    (old / "model.safetensors").write_bytes(b"another machine's model")
    assert weights_sha256(ensure_tiny_model(default_task(), default_spec(), tmp_path)) == RECORDED
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [old.name]


def test_a_damaged_package_is_refused(tmp_path, monkeypatch):
    bad = tmp_path / "pkg"
    bad.mkdir()
    for name in shipped.FILES:
        (bad / name).write_bytes((shipped.SHIPPED_DIR / name).read_bytes())
    with open(bad / "model.safetensors", "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x00")
    monkeypatch.setattr(shipped, "TINY", dataclasses.replace(shipped.TINY, dir=bad))
    with pytest.raises(shipped.ShippedModelError, match="sha256"):
        ensure_tiny_model(default_task(), default_spec(), tmp_path / "cache")


def test_another_spec_is_built_here(tmp_path):
    spec = default_spec(hidden_size=64, num_heads=2, num_kv_heads=1, warm_start_steps=2)
    path = ensure_tiny_model(AdditionTask(max_operand=19), spec, tmp_path)
    assert cache_key(AdditionTask(max_operand=19), spec) != shipped.CACHE_KEY
    built = json.loads((path / "asyncrl_build.json").read_text())
    assert built["spec"]["hidden_size"] == 64 and "weights_sha256" not in built
    assert weights_sha256(path) not in (None, RECORDED)


@pytest.mark.slow
def test_two_fresh_builds_give_the_recorded_weights(tmp_path):
    """Built from scratch (never copied) in fresh processes with 1 and 2 threads, the
    default model is byte for byte the shipped one: on this machine's kind of CPU the
    build does not depend on the thread count (nor on anything else but the seed)."""

    def build(threads: int) -> str:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        out = subprocess.run(
            [sys.executable, "-m", "asyncrl.models.tiny", "--rebuild", str(tmp_path / f"t{threads}")],
            capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200, check=True,
        ).stdout.split()  # fmt: skip
        return out[-1]

    first = build(1)
    if first != RECORDED and torch.backends.cpu.get_cpu_capability() != "AVX2":
        pytest.skip(f"this CPU's kernels ({torch.backends.cpu.get_cpu_capability()}) build "
                    f"another model ({first[:12]}): why the default one ships")  # fmt: skip
    assert [first, build(2)] == [RECORDED, RECORDED]


# ---- what a seed decides -----------------------------------------------------------------
def test_prompt_order_follows_the_seed():
    def draw(seed: int) -> list[str]:
        s = TaskSampler(AdditionTask(max_operand=19), seed)
        return [s.next().text for _ in range(64)]

    assert draw(3) == draw(3)
    assert draw(3) != draw(4)


def test_learner_step_on_a_fixed_batch_is_bit_identical(tmp_path):
    """The same weights, batch and settings give the same step, bit for bit (same
    thread count; the learner has no randomness of its own)."""
    from asyncrl.learner.batch import collate
    from asyncrl.learner.config import LearnerSettings
    from asyncrl.learner.learner import Learner
    from asyncrl.losses.advantages import GroupNormalized
    from asyncrl.losses.clipped import ClippedISLoss

    model_dir = build_tiny_qwen(tmp_path)
    batch = trajs(12, seed=5)
    runs = []
    for _ in range(2):
        learner = Learner(
            str(model_dir), ClippedISLoss(), GroupNormalized(),
            LearnerSettings.defaults(optim=plain_optim(lr=1e-2)),
        )  # fmt: skip
        metrics = [learner.step_on_batch(collate(batch), v) for v in range(2)]
        runs.append((metrics, [p.detach().clone() for p in learner.model.parameters()]))
    (m1, p1), (m2, p2) = runs

    def untimed(ms: list[dict]) -> list[dict]:
        return [{k: v for k, v in m.items() if "seconds" not in k and "per_s" not in k} for m in ms]

    assert untimed(m1) == untimed(m2) and m1[1]["loss/total"] != 0
    assert all(torch.equal(a, b) for a, b in zip(p1, p2))


# ---- the fingerprint ---------------------------------------------------------------------
def test_fingerprint_says_what_ran(tmp_path):
    cfg = OmegaConf.create({"seed": 3, "lr": "${x}", "x": 0.5})
    model = ensure_tiny_model(default_task(), default_spec(), tmp_path)
    fp = fingerprint(cfg, model, 3, shipped.WEIGHTS_SHA256)
    assert fp["model"] == {"path": str(model), "weights_sha256": RECORDED, "shipped": True}
    resolved = OmegaConf.to_yaml(cfg, resolve=True).encode()
    assert fp["config_sha256"] == hashlib.sha256(resolved).hexdigest()
    assert fp["seed"] == 3
    assert fp["versions"]["torch"] == torch.__version__
    assert set(fp["versions"]) == {"python", "torch", "vllm", "transformers", "ray"}
    hw = fp["hardware"]
    assert hw["cpu"] and hw["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert (hw["gpu"] is None) == (not torch.cuda.is_available())
    json.dumps(fp)  # summary.json and fingerprint.json take it as it is
    cols = flat(fp)
    assert cols["fp_model_weights_sha256"] == RECORDED and cols["fp_seed"] == 3
    assert f"| model_weights_sha256 | {RECORDED} |" in markdown(fp)


def test_fingerprint_of_another_model_is_not_shipped(tmp_path):
    fp = fingerprint(None, build_tiny_qwen(tmp_path), None, shipped.WEIGHTS_SHA256)
    assert fp["model"]["shipped"] is False and len(fp["model"]["weights_sha256"]) == 64
    assert fp["config_sha256"] is None


def test_config_hash_changes_with_any_value():
    a = OmegaConf.create({"learner": {"lr": 1e-3}, "seed": 0})
    b = OmegaConf.create({"learner": {"lr": 2e-3}, "seed": 0})
    assert config_sha256(a) == config_sha256(OmegaConf.create({"learner": {"lr": 1e-3}, "seed": 0}))
    assert config_sha256(a) != config_sha256(b)


def test_git_state_of_this_checkout_and_of_an_install(tmp_path):
    state = git_state(ROOT)
    if (ROOT / ".git").exists():
        assert len(state["commit"]) == 40 and isinstance(state["dirty"], bool)
    assert git_state(tmp_path) == {"commit": None, "dirty": None}  # e.g. a wheel install


def test_cpu_model_reads_the_first_processor(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
        "model name\t: AMD EPYC 9R14\nstepping\t: 1\n\nprocessor\t: 1\nmodel name\t: other\n"
    )
    assert cpu_model(info) == {
        "name": "AMD EPYC 9R14",
        "id": "vendor_id AuthenticAMD cpu family 25 model 17 stepping 1",
    }
    assert cpu_model(tmp_path / "missing")["id"] is None


def test_group_seeds_follow_the_run_seed_and_the_index():
    from fake_engine import FakeEngine

    from asyncrl.engine.protocol import GROUP_SEED_STRIDE, group_sampling, policy_sampling
    from asyncrl.engine.settings import SamplingSettings

    sampling = SamplingSettings.defaults(n=4, temperature=1.0, max_tokens=6)
    params = policy_sampling(sampling)
    engine = FakeEngine(seed=3)
    assert group_sampling(engine, params, 5).seed == 3 * GROUP_SEED_STRIDE + 5 * sampling.n
    assert params.seed is None  # the shared sampling stays unseeded
    assert group_sampling(FakeEngine(), params, 5) is params  # an engine without a seed
