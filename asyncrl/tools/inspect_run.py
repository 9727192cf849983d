"""``asyncrl-inspect RUN_DIR``: what a run did, from its directory alone.

    RUN_DIR/summary.json            ─▶ the summary (absent: the run did not finish)
    RUN_DIR/trajectories/part-*     ─▶ filters (--step, --staleness, --reward, --length)
                                    ─▶ best / worst / most stale / most mismatched
    --traj ID                       ─▶ one trajectory token by token: text, mask, version,
                                       behaviour vs learner log-prob, IS weight, advantage
    --html OUT                      ─▶ a one-page report with plots (tools/report.py)

Mismatch of a trajectory: the largest |learner - behaviour| log-prob over its trained
tokens (what ``is/mismatch_abs_max`` is over a batch).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.utils.runlog import read_trajectories

TEXT_WIDTH = 36  # characters of prompt/response shown in a table row
SUMMARY_KEYS = (
    "steps",
    "policy_version",
    "reward_mean_first",
    "reward_mean_last",
    "trajectories_produced",
    "trajectories_trained",
    "trajectories_dropped_stale",
    "max_staleness_trained",
    "max_staleness_bound",
    "tokens_generated",
    "tokens_trained",
    "wall_seconds",
)


def load_rows(run_dir: Path) -> list[dict[str, Any]]:
    """Every logged trajectory with its ``mismatch`` (None: no learner log-probs)."""
    rows = read_trajectories(run_dir).to_pylist()
    for r in rows:
        r["mismatch"] = mismatch(r)
    return rows


def mismatch(r: dict[str, Any]) -> float | None:
    lp, blp, mask = r.get("learner_logprobs"), r["behaviour_logprobs"], r["loss_mask"]
    if not lp or not any(mask):
        return None
    d = np.abs(np.asarray(lp, np.float64) - np.asarray(blp, np.float64))[np.asarray(mask, bool)]
    return float(d.max())


def _range(text: str | None, cast: type) -> tuple[Any, Any] | None:
    """``A:B``, ``A:``, ``:B`` or ``A`` (exactly A)."""
    if text is None:
        return None
    lo, sep, hi = text.partition(":")
    if not sep:
        return cast(lo), cast(lo)
    return (cast(lo) if lo else None), (cast(hi) if hi else None)


def _within(v: Any, rng: tuple[Any, Any] | None) -> bool:
    if rng is None:
        return True
    lo, hi = rng
    return (lo is None or v >= lo) and (hi is None or v <= hi)


def select(rows: list[dict], step=None, staleness=None, reward=None, length=None) -> list[dict]:
    """Rows inside every given range (``(lo, hi)``, None: open)."""
    return [
        r
        for r in rows
        if _within(r["step"], step)
        and _within(r["staleness"], staleness)
        and _within(r["reward"], reward)
        and _within(r["response_tokens"], length)
    ]


def rankings(rows: list[dict], k: int) -> dict[str, list[dict]]:
    mism = [r for r in rows if r["mismatch"] is not None]
    return {
        "best (highest reward)": sorted(rows, key=lambda r: -r["reward"])[:k],
        "worst (lowest reward)": sorted(rows, key=lambda r: r["reward"])[:k],
        "most stale": sorted(rows, key=lambda r: -r["staleness"])[:k],
        "most mismatched (max |learner - behaviour| log-prob)": sorted(
            mism, key=lambda r: -r["mismatch"]
        )[:k],
    }


def _clip(s: str, n: int = TEXT_WIDTH, tail: bool = False) -> str:
    """``s`` in ``n`` characters; ``tail``: keep its end (ids differ at the end)."""
    s = s.replace("\n", "\\n")
    if len(s) <= n:
        return s
    return "…" + s[-(n - 1) :] if tail else s[: n - 1] + "…"


def table(rows: list[dict]) -> str:
    head = f"{'step':>5} {'traj_id':<22} {'reward':>7} {'stale':>5} {'len':>4} {'mism':>7}  prompt → response"
    lines = [head, "-" * len(head)]
    for r in rows:
        m = "-" if r["mismatch"] is None else f"{r['mismatch']:.4f}"
        lines.append(
            f"{r['step']:>5} {_clip(r['traj_id'], 22, tail=True):<22} {r['reward']:>7.3f} "
            f"{r['staleness']:>5} {r['response_tokens']:>4} {m:>7}  "
            f"{_clip(r['prompt'])} → {_clip(r['response'])}"
        )
    return "\n".join(lines)


def token_table(r: dict, decode=None) -> str:
    """One trajectory token by token."""
    n = r["response_tokens"]
    lp = r.get("learner_logprobs") or [None] * n
    isw = r.get("is_weights") or [None] * n
    adv = r.get("advantages") or [None] * n

    def f(x: float | None, w: int = 9) -> str:
        return f"{'-':>{w}}" if x is None else f"{x:>{w}.4f}"

    head = (
        f"{'#':>4} {'token':<14} {'mask':>4} {'ver':>4} {'behaviour':>9} {'learner':>9} "
        f"{'Δlogp':>9} {'IS w':>9} {'adv':>9}"
    )
    lines = [
        f"trajectory {r['traj_id']} (group {r['group_id']}, step {r['step']}, reward "
        f"{r['reward']:.4f}, staleness {r['staleness']}, finish {r['finish_reason']})",
        f"prompt: {r['prompt']!r}",
        *(
            [
                f"images: {', '.join(r['images'])} (in the run's trajectories/; the prompt's, "
                "then the observations', in placeholder order)"
            ]
            if r.get("images")
            else []
        ),
        f"response: {r['response']!r}",
        head,
        "-" * len(head),
    ]
    for i in range(n):
        tid = r["response_ids"][i]
        text = repr(decode(tid)) if decode else str(tid)
        b = r["behaviour_logprobs"][i]
        d = None if lp[i] is None else lp[i] - b
        lines.append(
            f"{i:>4} {_clip(text, 14):<14} {'y' if r['loss_mask'][i] else 'n':>4} "
            f"{r['versions'][i]:>4} {f(b)} {f(lp[i])} {f(d)} {f(isw[i])} {f(adv[i])}"
        )
    return "\n".join(lines)


def tokenizer_decode(run_dir: Path):
    """``token id -> text`` from the run's model directory, or None (ids are shown)."""
    path = None
    s = run_dir / "summary.json"
    if s.is_file():
        path = json.loads(s.read_text()).get("fingerprint", {}).get("model", {}).get("path")
    if path is None and (run_dir / "config.yaml").is_file():
        from omegaconf import OmegaConf

        from asyncrl.wiring import build_task, resolve_model

        cfg = OmegaConf.load(run_dir / "config.yaml")
        try:  # the tiny model: its cached directory, as the run resolved it
            path = resolve_model(cfg, build_task(cfg))
        except Exception:  # noqa: BLE001 - no tokenizer: the table shows token ids
            path = None
    if not path or not Path(path, "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(path, "tokenizer.json")))
    return lambda i: tok.decode([int(i)], skip_special_tokens=False)


def summary_text(run_dir: Path) -> str:
    f = run_dir / "summary.json"
    if not f.is_file():
        return f"{run_dir}: no summary.json (the run did not finish); the log's parts follow"
    s = json.loads(f.read_text())
    lines = [f"run {run_dir}"] + [f"  {k}: {s[k]}" for k in SUMMARY_KEYS if k in s]
    if s.get("staleness_histogram"):
        lines.append(f"  staleness_histogram: {s['staleness_histogram']}")
    for name, a in (s.get("alerts") or {}).items():
        lines.append(f"  alert {name}: {a['steps']} steps, first at step {a['first_step']}")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="asyncrl-inspect", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--top", type=int, default=5, help="rows per table")
    p.add_argument("--traj", help="one trajectory id, token by token")
    p.add_argument("--step", help="A, A:B, A: or :B")
    p.add_argument("--staleness", help="A, A:B, A: or :B")
    p.add_argument("--reward", help="A, A:B, A: or :B")
    p.add_argument("--length", help="response tokens: A, A:B, A: or :B")
    p.add_argument("--html", type=Path, help="write a one-page report with plots here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    try:
        rows = load_rows(a.run_dir)
        ranges = dict(
            step=_range(a.step, int),
            staleness=_range(a.staleness, int),
            reward=_range(a.reward, float),
            length=_range(a.length, int),
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"asyncrl-inspect: {e}", file=sys.stderr)
        return 2
    if a.traj:
        found = [r for r in rows if r["traj_id"] == a.traj]
        if not found:
            print(f"asyncrl-inspect: no trajectory {a.traj!r} in the log", file=sys.stderr)
            return 2
        print(token_table(found[0], tokenizer_decode(a.run_dir)))
        return 0
    print(summary_text(a.run_dir))
    chosen = select(rows, **ranges)
    print(f"\n{len(chosen)} of {len(rows)} logged trajectories match the filters")
    for title, part in rankings(chosen, a.top).items():
        print(f"\n== {title} ==\n{table(part)}")
    if a.html:
        from asyncrl.tools.report import write_report

        framed = any(r.get("frames") for r in rows)  # the turns' actions, decoded
        write_report(a.run_dir, rows, a.html, tokenizer_decode(a.run_dir) if framed else None)
        print(f"\nreport: {a.html}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
