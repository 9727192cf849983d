"""``replay.max_staleness=auto`` through the command line (the shared short run,
tests/conftest.py ``short_cli_run``): ``replay/bound`` in TensorBoard at every step, no
batch staler than the bound it was taken under, one log line per change with its reason,
the summary's bound figures and exact accounting."""

from __future__ import annotations

import json
import re

import pytest
from helpers import SHORT_RUN_AUTO_BOUND, SHORT_RUN_STEPS

pytestmark = pytest.mark.slow  # the shared short run

STEPS = SHORT_RUN_STEPS
CHANGE = re.compile(r"replay\.max_staleness (\d+) -> (\d+): (.+) \(step (\d+)\)$")


def test_an_auto_bound_steers_and_is_logged(short_cli_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert SHORT_RUN_AUTO_BOUND == ("replay.max_staleness=auto", "replay.auto_widen_after=2")
    out = short_cli_run
    s = json.loads((out / "summary.json").read_text())
    assert s["trajectories_produced"] == (
        s["trajectories_trained"] + s["trajectories_dropped_stale"] + s["trajectories_in_flight"]
    )
    ea = EventAccumulator(str(out / "tb"))
    ea.Reload()
    bound = {e.step: e.value for e in ea.Scalars("replay/bound")}
    stale = {e.step: e.value for e in ea.Scalars("staleness/max")}
    assert sorted(bound) == list(range(1, STEPS + 1))
    assert all(1 <= b <= 8 for b in bound.values())  # auto_floor, auto_ceiling
    assert all(stale[v] <= bound[v] for v in bound), (stale, bound)
    lines = [m for x in (out / "train.log").read_text().splitlines() if (m := CHANGE.search(x))]
    assert len(lines) == s["staleness_bound_changes"] >= 1  # the tiny run's ESS is ~0.99
    assert int(lines[-1][2]) == s["staleness_bound_final"]
    for m in lines:  # each change moves the bound from where it was, for a reason
        old, new, why, step = int(m[1]), int(m[2]), m[3], int(m[4])
        assert "is/ess" in why or "is/mismatch_kl" in why
        assert bound[step] == old and (step == STEPS or bound[step + 1] == new)
    # the widest bound in force: one a step's batch was taken under, or the last change
    assert s["max_staleness_bound"] == max([*bound.values(), s["staleness_bound_final"]])
