"""A dead learner rank: stop generating, start the run's parts again, resume from the
newest complete checkpoint and train on to ``max_steps`` (``fault.max_restarts`` times).

    segment 1:  start_parts ─▶ resume (resume=, or version 0) ─▶ run_loop ─▶ final save
                                 │ a learner rank dies: the step's ray.get, the publish
                                 │ or a save raises, and a ping finds a rank dead
                                 ▼
                stop_parts(quiet): broker closed, actors halted, the queue's accounting
                read, the ranks' placement group freed (Ray stays up)
                a restart left ─▶ segment 2: start_parts ─▶ resume (the run directory's
                                  newest complete checkpoint, else resume=, else 0) ─▶ …
                none left ─────▶ RunError: one line, exit 3

Every part restarts, not only the learner and the broker: the restored policy is older
than the weights the engines hold and the trajectories queued (tagged with versions up
to the death); keeping them would run versions backwards under the staleness bound, and
the broker's process group with the engines' workers would have to re-form around a new
rank 0. The price is the engines' start (~25-60 s each on a CPU).

Accounting over the whole run: a resumed queue holds the checkpoint's accounting (what
it had queued counted dropped, ``ReplayBuffer.resume_from``) plus the new segment's;
what a dead segment produced after that checkpoint (trained in steps the restart threw
away, queued, or in flight) is added to both produced and dropped
(``trajectories_dropped_restart``). So produced = trained + dropped + in flight holds
exactly, and ``trained`` counts the trajectories of the steps the final policy comes from.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from asyncrl.loop import LoopResult, RunError

log = logging.getLogger(__name__)

# A live rank answers a ping between two calls; a dead one raises at once. A rank busy
# in a long step does not answer within this and counts as alive (the error re-raised).
RANK_PING_TIMEOUT_S = 10.0


def dead_ranks(learner: Any) -> dict[int, str]:
    """Rank -> why, for every rank of ``learner`` (a LearnerGroup) whose process is gone."""
    import ray

    ranks = list(learner.ranks)
    refs = [r.ping.remote() for r in ranks]
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=RANK_PING_TIMEOUT_S)
    dead = {}
    for rank, ref in enumerate(refs):
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError as e:
            dead[rank] = type(e).__name__
        except Exception:  # noqa: BLE001 - busy or another error: not a dead process
            pass
    return dead


def learner_death(error: BaseException, learner: Any) -> str | None:
    """One line saying which ranks died and what surfaced it, or None when every rank
    lives (``error`` is then someone else's: the caller re-raises it)."""
    dead = dead_ranks(learner)
    if not dead:
        return None
    ranks = ", ".join(f"rank {r}: {why}" for r, why in sorted(dead.items()))
    return f"{ranks} (surfaced as {type(error).__name__})"


@dataclass
class Restart:
    """One restart after a learner death."""

    error: str
    died_after_version: int  # the last step logged before the death
    detected_at: float  # unix time the driver saw the death
    stopped_at: float | None = None  # the dead segment's parts stopped
    from_version: int | None = None  # the version the next segment resumed from
    checkpoint: str | None = None  # what it resumed from (None: the model's weights)
    resumed_at: float | None = None  # the new parts started and the checkpoint loaded
    first_step_at: float | None = None  # unix time of the first step after the restart

    def seconds(self) -> float | None:
        """The driver seeing the death -> the first step after it."""
        return _span(self.detected_at, self.first_step_at)

    def phases(self) -> dict[str, float | None]:
        """Where the seconds went: stopping the dead segment's parts, starting new ones
        and loading the checkpoint (the engines' start is most of it), the first batch
        and step."""
        return {
            "stop_seconds": _span(self.detected_at, self.stopped_at),
            "start_seconds": _span(self.stopped_at, self.resumed_at),
            "first_step_seconds": _span(self.resumed_at, self.first_step_at),
        }


def _span(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(b - a, 2)


def close_dead_learner(parts: Any) -> None:
    """Before ``stop_parts``: kill the weight broker's actor instead of closing it (a
    close waits for the sync in flight, whose sender, rank 0, may be the dead one: the
    broker's deadlines then held the stop ~600 s), then close the ranks (the dead
    rank's error is already reported; its multi-line Ray message would follow as a
    warning in ``stop_parts``)."""
    import ray

    handle = getattr(parts.broker, "handle", None)  # the process-group broker's actor
    if handle is not None:
        ray.kill(handle, no_restart=True)
        parts.broker = None
    try:
        parts.learner.close(timeout_s=RANK_PING_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - a dead rank's close fails; its group is freed
        log.debug("closing the learner after a rank died: %s", type(e).__name__)


class RestartLedger:
    """The run's metrics sink, passed through, plus what the summary needs across
    segments: each step's reward sum/count and trained tokens by version (``run_loop``'s
    own result covers only its segment), the restarts, and the dead segments'
    production and generated tokens."""

    def __init__(self, sink: Any, max_restarts: int, run_dir: Path, resume: str | None):
        self.sink = sink
        self.max_restarts = max_restarts
        self.run_dir = Path(run_dir)
        self.resume_arg = resume
        self.steps: dict[int, tuple[float, float, int]] = {}  # version -> (sum, count, tokens)
        self.redone = 0  # steps trained, then thrown away by a restart
        self.restarts: list[Restart] = []
        self.dropped_restart = 0  # produced by dead segments after their checkpoint
        self.tokens_before = 0  # generated by the dead segments' actors
        self._produced_at_death: int | None = 0
        self._actor_faults: list[dict[str, Any]] = []  # the dead segments' ``fault`` entries

    # ---- the sink ---------------------------------------------------------------------
    def log(self, step: int, metrics: dict[str, float]) -> None:
        if "reward/sum" in metrics:  # a training step (not the evaluation's last values)
            self.steps[step] = (
                float(metrics["reward/sum"]),
                float(metrics["reward/count"]),
                int(metrics.get("tokens/trained", 0)),
            )
            if self.restarts and self.restarts[-1].first_step_at is None:
                self.restarts[-1].first_step_at = time.time()
        self.sink.log(step, metrics)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sink, name)

    # ---- segments ---------------------------------------------------------------------
    def resume(self, parts: Any) -> int:
        """Load the segment's starting point into freshly started ``parts``; returns its
        version. After a death: the run directory's newest complete checkpoint, else
        ``resume=``, else version 0 (the model's weights: with learner.checkpoint_every=0
        a restart trains from the start again)."""
        from asyncrl.learner.resume import resume_state

        path = self._source()
        version, ds = resume_state(parts, path) if path else (0, {})
        self._log_pids(parts)
        if not self.restarts:
            return version
        r = self.restarts[-1]
        r.from_version, r.checkpoint, r.resumed_at = version, path, time.time()
        saved = int(((ds.get("queue") or {}).get("acc") or {}).get("produced", 0))
        if self._produced_at_death is not None:  # None: the queue was unreachable
            self.dropped_restart += self._produced_at_death - saved
        gone = [v for v in self.steps if v > version]
        for v in gone:
            del self.steps[v]
        self.redone += len(gone)
        log.warning(
            "learner restart %d of fault.max_restarts=%d: resumed from version %d (%s); "
            "%d steps to train again",
            len(self.restarts), self.max_restarts, version,
            path or "no checkpoint: the model's weights", len(gone),
        )  # fmt: skip
        return version

    def record_death(
        self, why: str, detected_at: float, queue_stats: dict, actor_stats: dict,
        actor_faults: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        """After the dead segment's parts stopped (``queue_stats``: its final accounting;
        ``actor_faults``: its supervisor's ``fault`` entry). Raises :class:`RunError`
        (one line, exit 3) when no restart is left."""
        if actor_faults:
            self._actor_faults.append(actor_faults)
        last = max(self.steps, default=0)
        self.restarts.append(Restart(why, last, detected_at, stopped_at=time.time()))
        self.tokens_before += sum(
            s.get("tokens", 0) for s in actor_stats.values() if isinstance(s, dict)
        )
        produced = queue_stats.get("produced")
        self._produced_at_death = None if produced is None else int(produced)
        if produced is None:
            log.warning("the dead segment's queue was unreachable: its production after "
                        "the checkpoint is not in the accounting")  # fmt: skip
        acc = ", ".join(f"{k} {queue_stats[k]}" for k in
                        ("produced", "trained", "dropped_stale", "in_flight") if k in queue_stats)  # fmt: skip
        if len(self.restarts) > self.max_restarts:
            newest = self._newest_checkpoint()
            raise RunError(
                f"a learner rank died after version {last}: {why}; fault.max_restarts="
                f"{self.max_restarts}: no restart left (newest complete checkpoint: "
                f"{newest or 'none'}); queue: {acc or 'unreachable'}; outputs so far: "
                f"{self.run_dir}"
            )
        log.warning("a learner rank died after version %d: %s; queue: %s; restarting the "
                    "run's parts", last, why, acc or "unreachable")  # fmt: skip

    def _source(self) -> str | None:
        if self.restarts:
            newest = self._newest_checkpoint()
            if newest:
                return newest
        return self.resume_arg or None

    def _newest_checkpoint(self) -> str | None:
        from asyncrl.learner.layout import CheckpointError, find_latest, verify

        try:
            p = find_latest(self.run_dir)
            verify(p, full=False)
            return str(p)
        except (CheckpointError, OSError, ValueError):
            return None

    def _log_pids(self, parts: Any) -> None:
        import ray

        pids = ray.get([r.pid.remote() for r in parts.learner.ranks])
        log.info("learner ranks up (segment %d): pids %s", len(self.restarts) + 1, pids)

    # ---- the summary ------------------------------------------------------------------
    def whole_run(self, loop: LoopResult, queue_stats: dict) -> tuple[LoopResult, dict]:
        """The last segment's loop result and accounting, over every segment."""
        if not self.restarts:
            return loop, queue_stats
        versions = sorted(self.steps)
        whole = LoopResult(
            steps=len(versions),
            policy_version=loop.policy_version,
            per_step=[self.steps[v][:2] for v in versions],
            tokens_trained=sum(self.steps[v][2] for v in versions),
            phases=loop.phases,
        )
        q = dict(queue_stats)
        q["produced"] = q["produced"] + self.dropped_restart
        q["dropped_stale"] = q["dropped_stale"] + self.dropped_restart
        return whole, q

    def actor_faults(self, last: dict[str, Any]) -> dict[str, Any]:
        """summary.json's ``fault`` entry (asyncrl/fault/actors.py) over every segment:
        the restarts, recoveries and events of the dead segments' actors too. The dead
        actors and ``groups_lost`` are the last segment's (its queue's accounting)."""
        out = dict(last)
        for d in self._actor_faults:
            out["actor_restarts"] = out.get("actor_restarts", 0) + d.get("actor_restarts", 0)
            by = dict(out.get("actor_restarts_by_actor", {}))
            for k, v in d.get("actor_restarts_by_actor", {}).items():
                by[k] = by.get(k, 0) + v
            out["actor_restarts_by_actor"] = by
            for k in ("recovery_seconds", "actor_events"):
                out[k] = [*d.get(k, []), *out.get(k, [])]
        return out

    def summary(self) -> dict[str, Any]:
        """``learner_restarts``, ``steps_redone``, ``restart_seconds`` (the driver seeing
        the death -> the first step after it), ``restarts`` (each one's record) and
        ``trajectories_dropped_restart`` (part of ``trajectories_dropped_stale``)."""
        return {
            "learner_restarts": len(self.restarts),
            "steps_redone": self.redone,
            "restart_seconds": [r.seconds() for r in self.restarts],
            "restarts": [
                {**asdict(r), "seconds": r.seconds(), **r.phases()} for r in self.restarts
            ],
            "trajectories_dropped_restart": self.dropped_restart,
        }
