"""``asyncrl-inspect RUN_DIR --html OUT``: one self-contained page (PNG plots embedded as
base64) a person would rather look at than read: the reward curve, the staleness
histogram, IS statistics, the step time split between generation wait / training /
weight sync, the broker's timings, and the alerts and summary; for a run whose prompts
show images, the last logged ones beside their responses; for a run whose env kept a
picture after each turn (``Trajectory.frames``: env=browser's screenshots), one episode
step by step, each turn's action beside the picture after it.

The series come from the run's TensorBoard events (every step) and its trajectory log;
a series the run did not log is left out of its plot, never invented.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.utils.runlog import LOG_DIR


def scalars(run_dir: Path) -> dict[str, tuple[list[int], list[float]]]:
    """``tag -> (steps, values)`` of every scalar in RUN_DIR/tb (all points kept)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = run_dir / "tb"
    if not tb.is_dir():
        return {}
    ea = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    ea.Reload()
    out = {}
    for tag in ea.Tags()["scalars"]:
        ev = ea.Scalars(tag)
        out[tag] = ([e.step for e in ev], [e.value for e in ev])
    return out


def _plt():
    """matplotlib's pyplot, drawing off-screen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    _plt().close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _lines(ax, s: dict, tags: list[str]) -> bool:
    drawn = False
    for t in tags:
        if t in s:
            ax.plot(*s[t], label=t, lw=1.2)
            drawn = True
    if drawn:
        ax.legend(fontsize=7)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    return drawn


def figures(s: dict, rows: list[dict], summary: dict) -> dict[str, str]:
    """Title -> base64 PNG; a plot none of whose series the run logged is left out.
    ``s``: :func:`scalars`; ``rows``: the trajectory log's rows; ``summary``: summary.json."""
    drawn = {
        "Reward": _reward(s, rows),
        "Staleness": _staleness(rows, summary),
        "IS statistics": _importance(s),
        "Throughput split": _step_split(s),
        "Broker": _broker(s),
        "Alerts": _alerts(s),
    }
    return {title: png for title, png in drawn.items() if png is not None}


def _reward(s: dict, rows: list[dict]) -> str:
    fig, ax = _plt().subplots(figsize=(6, 3))
    if rows:  # the log's per-step mean, beside the TensorBoard series; the log's step
        # is the version a batch trained from, TensorBoard's the version it published (+1)
        steps = sorted({r["step"] for r in rows})
        by = {k: [r["reward"] for r in rows if r["step"] == k] for k in steps}
        means = [np.mean(by[k]) for k in steps]
        label = "logged trajectories, mean per step"
        ax.plot([k + 1 for k in steps], means, "o", ms=3, alpha=0.5, label=label)
    _lines(ax, s, ["reward/mean"])
    ax.set_title("reward")
    ax.legend(fontsize=7)
    return _png(fig)


def _staleness(rows: list[dict], summary: dict) -> str | None:
    """The summary's whole-run histogram, else the logged trajectories'."""
    hist = summary.get("staleness_histogram") or {}
    stale = [r["staleness"] for r in rows]
    if not hist and not stale:
        return None
    fig, ax = _plt().subplots(figsize=(6, 3))
    if hist:
        ax.bar([int(k) for k in hist], list(hist.values()), color="tab:blue")
        ax.set_xticks([int(k) for k in hist])
        ax.set_title("staleness of trained trajectories (summary, whole run)")
    else:
        ax.hist(stale, bins=range(max(stale) + 2), color="tab:blue", align="left")
        ax.set_title("staleness of logged trajectories")
    ax.set_xlabel("learner version - min token version")
    return _png(fig)


def _importance(s: dict) -> str:
    fig, (a1, a2) = _plt().subplots(1, 2, figsize=(10, 3))
    _lines(a1, s, ["is/ess", "is/ratio_mean", "is/clip_frac"])
    a1.set_title("importance sampling")
    if _lines(a2, s, ["is/mismatch_kl"]):
        a2.set_yscale("symlog", linthresh=1e-6)
    a2.set_title("actor/learner mismatch KL")
    return _png(fig)


STEP_PHASES = {  # the loop's perf/*_seconds, stacked
    "perf/wait_seconds": "waiting for generation",
    "perf/train_seconds": "training",
    "perf/publish_seconds": "weight sync (publish)",
}


def _step_split(s: dict) -> str | None:
    split = [t for t in STEP_PHASES if t in s]
    if not split:
        return None
    fig, ax = _plt().subplots(figsize=(6, 3))
    steps = s[split[0]][0]
    ax.stackplot(steps, *[s[t][1] for t in split], labels=[STEP_PHASES[t] for t in split])
    ax.set_xlabel("step")
    ax.set_ylabel("seconds per step")
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title("step time: generation / training / sync")
    return _png(fig)


BROKER_TIMINGS = [
    "broker/sync_seconds",
    "broker/transfer_seconds",
    "broker/reload_seconds",
    "broker/pack_seconds",
    "broker/pause_seconds_max",
]


def _broker(s: dict) -> str | None:
    if not any(t in s for t in BROKER_TIMINGS):
        return None
    fig, ax = _plt().subplots(figsize=(6, 3))
    _lines(ax, s, BROKER_TIMINGS)
    ax.set_ylabel("seconds")
    ax.set_title("weight broker timings")
    return _png(fig)


def _alerts(s: dict) -> str | None:
    """One row per alert, a dot at each step it fired; none if none ever fired."""
    alerts = sorted(t for t in s if t.startswith("alerts/") and t != "alerts/firing")
    if not any(max(s[t][1]) > 0 for t in alerts):
        return None
    fig, ax = _plt().subplots(figsize=(6, 0.4 * len(alerts) + 1))
    for i, t in enumerate(alerts):
        st, v = s[t]
        ax.scatter([x for x, y in zip(st, v) if y], [i] * sum(1 for y in v if y), s=6)
    ax.set_yticks(range(len(alerts)), [t.removeprefix("alerts/") for t in alerts])
    ax.set_xlabel("step")
    ax.set_title("alerts firing")
    return _png(fig)


IMAGE_ROWS = 12  # logged trajectories with images shown in the report (the last ones)


def image_rows(run_dir: Path, rows: list[dict[str, Any]]) -> str:
    """The last :data:`IMAGE_ROWS` logged trajectories that show images: each image
    (``trajectories/images/*.png``, inlined) beside the response and its reward; "" when
    no row shows one."""
    with_images = [r for r in rows if r.get("images")][-IMAGE_ROWS:]
    cells = []
    for r in with_images:
        pics = "".join(
            f'<img alt="{html.escape(n)}" width="96" src="data:image/png;base64,'
            f'{base64.b64encode((run_dir / LOG_DIR / n).read_bytes()).decode()}">'
            for n in r["images"]
            if (run_dir / LOG_DIR / n).is_file()
        )
        cells.append(
            f"<tr><td>{pics}</td><td>{html.escape(repr(r['response']))}</td>"
            f"<td>reward {r['reward']:.3f}, step {r['step']}</td></tr>"
        )
    if not cells:
        return ""
    return f"<h2>Images and responses</h2><table>{''.join(cells)}</table>"


def turn_texts(r: dict[str, Any], decode: Callable[[int], str] | None) -> list[str]:
    """The policy's turns of a logged episode: each run of trained response tokens,
    decoded (``decode``: token id -> text), or "N tokens" without a tokenizer."""
    turns: list[list[int]] = []
    prev = False
    for tid, m in zip(r["response_ids"], r["loss_mask"]):
        if m and not prev:
            turns.append([])
        if m:
            turns[-1].append(tid)
        prev = m
    if decode is None:
        return [f"{len(t)} tokens" for t in turns]
    return ["".join(decode(i) for i in t) for t in turns]


def episode_steps(
    run_dir: Path, rows: list[dict[str, Any]], decode: Callable[[int], str] | None = None
) -> str:
    """One logged episode with frames (the last that scored above 0, else the last),
    step by step: each turn's action beside the picture after it; "" when none has
    frames."""
    with_frames = [r for r in rows if any(r.get("frames") or [])]
    if not with_frames:
        return ""
    r = ([x for x in with_frames if x["reward"] > 0] or with_frames)[-1]
    turns = turn_texts(r, decode)
    cells = []
    for i, name in enumerate(r["frames"]):
        action = turns[i] if i < len(turns) else ""
        f = run_dir / LOG_DIR / name
        pic = (
            f'<img alt="{html.escape(name)}" width="360" style="border:1px solid #999" '
            f'src="data:image/png;base64,{base64.b64encode(f.read_bytes()).decode()}">'
            if name and f.is_file()
            else "(no picture: the step did not act)"
        )
        cells.append(
            f"<tr><td>{i + 1}</td><td><code>{html.escape(action)}</code></td><td>{pic}</td></tr>"
        )
    task = json.loads(r.get("reward_breakdown") or "{}")
    kind = next((k.removeprefix("task/") for k in task if k.startswith("task/")), "")
    head = (
        f"<p>trajectory {html.escape(r['traj_id'])}{f', task {html.escape(kind)}' if kind else ''}"
        f", step {r['step']}, reward {r['reward']:.3f}, finish {html.escape(r['finish_reason'])}"
        f"</p><pre>{html.escape(r['prompt'])}</pre>"
    )
    return (
        f'<h2 id="episode">One episode, step by step</h2>{head}'
        f"<table><tr><th>turn</th><th>action</th><th>the page after it</th></tr>"
        f"{''.join(cells)}</table>"
    )


def write_report(
    run_dir: Path,
    rows: list[dict[str, Any]],
    out: Path,
    decode: Callable[[int], str] | None = None,
) -> Path:
    """The page at ``out``; ``decode`` (token id -> text) shows an episode's actions."""
    summary = {}
    if (run_dir / "summary.json").is_file():
        summary = json.loads((run_dir / "summary.json").read_text())
    figs = figures(scalars(run_dir), rows, summary)
    keep = {k: v for k, v in summary.items() if not isinstance(v, dict)}
    cells = "".join(
        f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>"
        for k, v in keep.items()
    )
    alerts = (
        "".join(
            f"<li>{html.escape(n)}: {a['steps']} steps, first at step {a['first_step']}</li>"
            for n, a in (summary.get("alerts") or {}).items()
        )
        or "<li>none</li>"
    )
    imgs = "".join(
        f"<figure><figcaption>{html.escape(t)}</figcaption>"
        f'<img alt="{html.escape(t)}" src="data:image/png;base64,{b}"></figure>'
        for t, b in figs.items()
    )
    shown = image_rows(run_dir, rows) + episode_steps(run_dir, rows, decode)
    page = f"""<!doctype html><html><head><meta charset="utf-8">
<title>asyncrl run {html.escape(run_dir.name)}</title>
<style>body{{font-family:sans-serif;margin:1.5em;max-width:1100px}}
figure{{display:inline-block;margin:0.5em;vertical-align:top}}
figcaption{{font-weight:bold}} td{{padding:0 0.8em;font-size:0.9em}}</style></head><body>
<h1>asyncrl run: {html.escape(str(run_dir))}</h1>
<p>{len(rows)} logged trajectories{"" if summary else "; no summary.json (the run did not finish)"}</p>
{imgs}
{shown}
<h2>Alerts</h2><ul>{alerts}</ul>
<h2>Summary</h2><table>{cells}</table>
</body></html>"""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    return out
