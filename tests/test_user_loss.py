"""A researcher's loss class in their own module (outside the package, found through
PYTHONPATH) runs through the real CLI, and its metric lands in TensorBoard; a wrong
argument to it stops the run at start-up naming what it accepts."""

from __future__ import annotations

import sys

import pytest
from helpers import SHORT_RUN_STEPS, composed, refused_before_ray, write_user_loss

pytestmark = pytest.mark.slow


def test_user_loss_through_cli(short_cli_run):
    """The shared short run (tests/conftest.py) trains with ``my_losses.scaled.ScaledPG``
    and ``+loss.alpha=0.3``: the class's metric is in TensorBoard at every step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(short_cli_run / "tb"))
    ea.Reload()
    values = [e.value for e in ea.Scalars("user/alpha_times_mask_mean")]
    assert len(values) == SHORT_RUN_STEPS and all(abs(v - 0.3) < 1e-6 for v in values)


def test_user_loss_wrong_argument_fails_at_startup(tmp_path, capsys, monkeypatch):
    """What the CLI runs after composing (exit 2, one line, before Ray);
    tests/test_startup_checks.py holds the command line's own part."""
    monkeypatch.syspath_prepend(str(write_user_loss(tmp_path)))
    for name in ("my_losses", "my_losses.scaled"):  # a fresh import from this tmp_path
        monkeypatch.delitem(sys.modules, name, raising=False)
    overrides = ("loss._target_=my_losses.scaled.ScaledPG", "+loss.beta=0.3", "progress=false")
    line = refused_before_ray(composed(*overrides), tmp_path, capsys, monkeypatch)
    assert "ScaledPG takes no argument(s) ['beta']; it accepts ['alpha']" in line
