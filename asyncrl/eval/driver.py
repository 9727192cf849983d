"""The driver's side of evaluation: what the training loop calls once per step.

    step(V):  the evaluation in flight finished? ─▶ its eval/* metrics (logged at V)
              V % eval.every == 0 ─▶ idle: the learner's weights of V to the object
                                       store (one small call, between two steps) and
                                       EvalActor.evaluate([ref], V), not awaited
                                   ─▶ busy: V skipped, counted (eval/skipped_versions)
                                       and said in one log line
    finish(): the evaluation still in flight is waited for (eval.timeout_s), so the
              summary holds the last one; no new one starts.

Training never waits for an evaluation: the only blocking call is the weights_ref of
version V, which the ranks answer from memory between two steps.
"""

from __future__ import annotations

import logging
from typing import Any

from asyncrl.eval.settings import EvalSettings

log = logging.getLogger(__name__)


class Evaluator:
    def __init__(self, settings: EvalSettings, actor: Any, learner_ranks: list[Any]):
        self.settings = settings
        self.actor = actor
        self.ranks = list(learner_ranks)
        self.pending: Any = None  # the ObjectRef of the evaluation in flight
        self.pending_version = -1
        self.skipped: list[int] = []
        self.history: dict[str, list[tuple[int, float, float]]] = {}  # set -> (V, p@1, p@k)
        self.seconds = 0.0

    def step(self, version: int) -> dict[str, float]:
        """Called by the loop after version ``version`` is published."""
        import ray

        m: dict[str, float] = {}
        if self.pending is not None:
            ready, _ = ray.wait([self.pending], timeout=0)
            if ready:
                m.update(self._collect())
        if version % self.settings.every == 0:
            if self.pending is None:
                self._start(version)
            else:
                self.skipped.append(version)
                log.warning(
                    "eval: version %d skipped: the evaluation of version %d is still running "
                    "(%d skipped so far; raise eval.every or lower eval.num_prompts)",
                    version, self.pending_version, len(self.skipped),
                )  # fmt: skip
        m["eval/skipped_versions"] = float(len(self.skipped))
        return m

    def _start(self, version: int) -> None:
        import ray

        got = ray.get([r.weights_ref.remote() for r in self.ranks])
        self.pending = self.actor.evaluate.remote(got[0]["refs"], version)
        self.pending_version = version

    def _collect(self) -> dict[str, float]:
        import ray

        ref, self.pending = self.pending, None
        res = ray.get(ref)
        v = int(res["version"])
        self.seconds += float(res["seconds"])
        m: dict[str, float] = {"eval/seconds": float(res["seconds"])}
        for name, r in res["sets"].items():
            self.history.setdefault(name, []).append((v, r["pass@1"], r["pass@k"]))
            m[f"eval/{name}/pass@1"] = r["pass@1"]
            m[f"eval/{name}/pass@k"] = r["pass@k"]
            m[f"eval/{name}/reward_mean"] = r["reward_mean"]
            if "tool_call_share" in r:  # a set scored as episodes (eval/actor.py)
                m[f"eval/{name}/tool_call_share"] = r["tool_call_share"]
            m[f"eval/{name}/version"] = float(v)
        log.info(
            "eval: version %d: %s (%.1f s)", v,
            ", ".join(f"{n} pass@1 {r['pass@1']:.3f} pass@{self.settings.k} {r['pass@k']:.3f}"
                      for n, r in res["sets"].items()),
            res["seconds"],
        )  # fmt: skip
        return m

    def finish(self) -> dict[str, float]:
        """Wait for the evaluation in flight (bounded); its metrics, or {}."""
        import ray

        if self.pending is None:
            return {}
        ready, _ = ray.wait([self.pending], timeout=self.settings.timeout_s)
        if not ready:
            log.warning("eval: the evaluation of version %d did not finish within "
                        "eval.timeout_s=%g s; left out", self.pending_version,
                        self.settings.timeout_s)  # fmt: skip
            self.pending = None
            return {}
        return self._collect()

    def summary(self) -> dict[str, Any]:
        """summary.json's ``eval``: per set, pass@1's first, last, best and the version
        of the best (the earliest on a tie), plus pass@k's last and the versions."""
        out: dict[str, Any] = {}
        for name, rows in self.history.items():
            best = max(rows, key=lambda r: (r[1], -r[0]))
            out[name] = {
                "first": rows[0][1],
                "last": rows[-1][1],
                "best": best[1],
                "version_best": best[0],
                "version_first": rows[0][0],
                "version_last": rows[-1][0],
                "pass@k_first": rows[0][2],
                "pass@k_last": rows[-1][2],
                "pass@k_best": max(r[2] for r in rows),
                "evaluations": len(rows),
            }
        return out
