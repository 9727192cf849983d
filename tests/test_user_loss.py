"""A researcher's loss class in their own module (outside the package, found through
PYTHONPATH) runs through the real CLI, and its metric lands in TensorBoard."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import composed, refused_before_ray

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[1]

USER_LOSS = textwrap.dedent("""
    import torch

    from asyncrl.losses import LossOutput, masked_mean, weighted_sum
    from asyncrl.losses.diagnostics import is_diagnostics


    class ScaledPG:
        needs_proximal = False
        needs_values = False

        def __init__(self, alpha: float = 1.0):
            self.alpha = alpha

        def __call__(self, batch, outputs):
            pg = -self.alpha * batch.advantages * outputs.logprobs
            metrics = is_diagnostics(batch, outputs)
            metrics["user/alpha_times_mask_mean"] = self.alpha * float(masked_mean(batch.mask.float(), batch.mask))
            return LossOutput(loss=weighted_sum(pg, batch), metrics=metrics)
""")


def test_user_loss_through_cli(tmp_path, tiny_model):
    pkg = tmp_path / "userlib" / "my_losses"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "scaled.py").write_text(USER_LOSS)
    out = tmp_path / "run"
    env = dict(
        os.environ,
        PYTHONPATH=f"{tmp_path / 'userlib'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl.train",
            f"hydra.run.dir={out}",
            "progress=false",
            "max_steps=4",
            "loss._target_=my_losses.scaled.ScaledPG",
            "+loss.alpha=0.3",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(out / "tb"))
    ea.Reload()
    values = [e.value for e in ea.Scalars("user/alpha_times_mask_mean")]
    assert len(values) == 4 and all(abs(v - 0.3) < 1e-6 for v in values)


def test_user_loss_wrong_argument_fails_at_startup(tmp_path, capsys, monkeypatch):
    """What the CLI runs after composing (exit 2, one line, before Ray);
    tests/test_startup_checks.py holds the command line's own part."""
    pkg = tmp_path / "userlib" / "my_losses"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "scaled.py").write_text(USER_LOSS)
    monkeypatch.syspath_prepend(str(tmp_path / "userlib"))
    for name in ("my_losses", "my_losses.scaled"):  # a fresh import from this tmp_path
        monkeypatch.delitem(sys.modules, name, raising=False)
    overrides = ("loss._target_=my_losses.scaled.ScaledPG", "+loss.beta=0.3", "progress=false")
    line = refused_before_ray(composed(*overrides), tmp_path, capsys, monkeypatch)
    assert "ScaledPG takes no argument(s) ['beta']; it accepts ['alpha']" in line
