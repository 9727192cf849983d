"""The wheel works outside the checkout: ``pip wheel .``, installed with ``--no-deps``
into a fresh venv whose dependencies come from this venv's site-packages (a ``.pth``
line: torch, vLLM and Ray are not downloaded again, and this venv's editable asyncrl
is not seen, since a ``.pth`` directory's own ``.pth`` files are not read), then
``asyncrl-train --cfg job`` and a two-step run from a directory that is not the
checkout: the configs and the tiny model come from the installed package."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[1]
SKIP = (".venv", ".git", ".cache", "outputs", "bench_out", "build", "*.egg-info", "__pycache__")


def _run(cmd: list[str], cwd: Path, env: dict, timeout: int) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{cmd}: rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # built from a copy: an in-tree build leaves build/ in the checkout (and would pack
    # whatever stale files another build left there)
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*SKIP))
    # no build isolation: this venv's setuptools builds it (no download, seconds)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", str(tmp / "dist"), str(src)], tmp, env, 600)  # fmt: skip
    (wheel,) = (tmp / "dist").glob("asyncrl-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp, env, 300)
    py = venv / "bin" / "python"
    purelib = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        tmp, env, 60).stdout.strip())  # fmt: skip
    (purelib / "deps-from-test-venv.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q",
          str(wheel)], tmp, env, 600)  # fmt: skip
    outside = tmp / "elsewhere"
    outside.mkdir()
    return {"venv": venv, "py": py, "cwd": outside, "env": env, "wheel": wheel}


def test_the_wheel_carries_the_configs_and_the_tiny_model(installed):
    import zipfile

    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    assert "asyncrl/conf/config.yaml" in names and "asyncrl/conf/model/smollm2.yaml" in names
    assert {p.relative_to(ROOT / "conf").as_posix() for p in (ROOT / "conf").rglob("*.yaml")} == {
        n.removeprefix("asyncrl/conf/") for n in names if n.startswith("asyncrl/conf/")
    }
    assert "asyncrl/models/tiny_default/model.safetensors" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


def test_installed_asyncrl_is_the_wheel_not_the_checkout(installed):
    r = _run([str(installed["py"]), "-c", "import asyncrl, asyncrl.confdir as c; "
              "print(asyncrl.__file__); print(c.conf_dir())"],
             installed["cwd"], installed["env"], 120)  # fmt: skip
    where, conf = r.stdout.split()
    assert str(installed["venv"]) in where and not where.startswith(str(ROOT / "asyncrl"))
    assert conf == str(Path(where).parent / "conf")


def test_cfg_job_from_outside_the_checkout(installed):
    r = _run([str(installed["venv"] / "bin" / "asyncrl-train"), "--cfg", "job"],
             installed["cwd"], installed["env"], 300)  # fmt: skip
    assert (
        "max_steps: 300" in r.stdout
        and "_target_: asyncrl.tasks.arithmetic.AdditionTask" in r.stdout
    )


def test_a_short_run_from_outside_the_checkout(installed, tmp_path):
    out = tmp_path / "run"
    env = {**installed["env"], "ASYNCRL_CACHE": str(tmp_path / "cache")}
    _run([str(installed["venv"] / "bin" / "asyncrl-train"), "max_steps=2", "progress=false",
          "learner.batch_groups=2", f"hydra.run.dir={out}"], installed["cwd"], env, 1200)  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["policy_version"] == 2
    assert summary["fingerprint"]["model"]["shipped"]  # copied from the installed package
    assert summary["trajectories_produced"] == (
        summary["trajectories_trained"] + summary["trajectories_dropped_stale"]
        + summary["trajectories_in_flight"]
    )  # fmt: skip
