"""asyncrl.tools.report.figures on series a run could have logged: a plot appears when
one of its series is there, and only then."""

from __future__ import annotations

import base64

from asyncrl.tools.report import figures

PNG = b"\x89PNG\r\n\x1a\n"


def series(*tags: str, n: int = 5) -> dict[str, tuple[list[int], list[float]]]:
    return {t: (list(range(1, n + 1)), [0.1 * i for i in range(n)]) for t in tags}


def test_every_plot_from_a_full_run():
    s = series(
        "reward/mean",
        "is/ess",
        "is/mismatch_kl",
        "perf/wait_seconds",
        "perf/train_seconds",
        "broker/sync_seconds",
        "alerts/mismatch_kl",
    )
    rows = [{"step": k, "reward": r, "staleness": k % 2} for k in range(4) for r in (0.0, 1.0)]
    figs = figures(s, rows, {"staleness_histogram": {"0": 3, "1": 5}})
    assert list(figs) == [
        "Reward",
        "Staleness",
        "IS statistics",
        "Throughput split",
        "Broker",
        "Alerts",
    ]
    assert all(base64.b64decode(png).startswith(PNG) for png in figs.values())


def test_plots_without_their_series_are_left_out():
    s = series("reward/mean", "alerts/staleness")
    s["alerts/staleness"] = ([1, 2], [0.0, 0.0])  # logged, never fired
    figs = figures(s, [], {})
    assert list(figs) == ["Reward", "IS statistics"]  # the IS axes are drawn empty


def test_staleness_from_the_log_without_a_summary():
    rows = [{"step": 0, "reward": 1.0, "staleness": 2}]
    assert "Staleness" in figures({}, rows, {})
