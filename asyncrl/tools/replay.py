"""``asyncrl-replay RUN_DIR --from-step S --steps N``: the learner's steps S..S+N-1 again,
offline, from the checkpoint at S, on exactly the batches the run trained on.

    RUN_DIR/config.yaml ─▶ the same loss, advantage, learner settings, model (checked as
                           a run checks them)
    RUN_DIR/checkpoints/step-S (log.keep_checkpoints) or RUN_DIR/checkpoint at S
                        ─▶ a learner in this process at version S (weights, optimizer, LR
                           schedule, RNG, the off-policy brake's scale)
    RUN_DIR/trajectories/batches.jsonl: step s's trajectory ids in training order, and
                        the loss and grad norm the run logged
    RUN_DIR/trajectories/part-*.parquet: those trajectories, token for token
                        ─▶ step_on_batch(collate(them), s) ─▶ loss and grad norm, beside
                           the logged ones

On the CPU with one learner rank the replayed values equal the logged ones bit for bit
(the same arithmetic in the same order); that is how a spike is debugged offline. A run
with several learner ranks replays on one: close, not bit-equal (the reduction order
differs). Needs the whole log (``log.sample_frac=1``, no ``log.max_rows`` cap).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.utils.runlog import LOG_DIR, read_batches, read_trajectories, trajectory_parts


class ReplayError(RuntimeError):
    """The run directory cannot be replayed as asked; the message says what is missing."""


def checkpoint_at(run_dir: Path, step: int) -> Path:
    """The checkpoint holding version ``step`` (the kept ones first, then the latest)."""
    from asyncrl.learner.layout import META

    kept = run_dir / "checkpoints" / f"step-{step}"
    if (kept / META).is_file():
        return kept
    last = run_dir / "checkpoint"
    if (last / META).is_file() and json.loads((last / META).read_text()).get("version") == step:
        return last
    have = sorted(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*"))
    raise ReplayError(
        f"{run_dir}: no checkpoint at step {step} (kept: {have or 'none'}); run with "
        "learner.checkpoint_every=K log.keep_checkpoints=true and start at a multiple of K"
    )


def trajectories_of(table: Any, ids: list[str], step: int, log_dir: Path | None = None) -> list:
    """The logged rows of ``ids`` as Trajectory objects, in ``ids`` order; a row's
    ``images`` read back from their files under ``log_dir`` (the run's log folder)."""
    from asyncrl.trajectory import Image, Trajectory

    rows = table.get(step)
    if rows is None:
        raise ReplayError(f"step {step}: no trajectory rows in the log")
    missing = [i for i in ids if i not in rows]
    if missing:
        raise ReplayError(
            f"step {step}: {len(missing)} of {len(ids)} trajectories are not in the log "
            "(log.sample_frac < 1 or log.max_rows?); replay needs them all"
        )
    out = []
    for i in ids:
        r = rows[i]
        if r.get("prompt_ids") is None:
            raise ReplayError(f"trajectory {i}: the log has no prompt_ids (an older run)")
        out.append(
            Trajectory(
                traj_id=i,
                group_id=r["group_id"],
                prompt_ids=np.asarray(r["prompt_ids"], np.int32),
                response_ids=np.asarray(r["response_ids"], np.int32),
                behaviour_logprobs=np.asarray(r["behaviour_logprobs"], np.float32),
                versions=np.asarray(r["versions"], np.int32),
                loss_mask=np.asarray(r["loss_mask"], bool),
                reward=float(r["reward"]),
                images=[
                    Image.of((log_dir or Path()).joinpath(n).read_bytes())
                    for n in r.get("images") or ()
                ],
                routed_experts=routed_experts(r),
            )
        )
    return out


def routed_experts(row: dict[str, Any]) -> np.ndarray | None:
    """A row's routed experts as the trajectory carried them (None: none logged)."""
    if row.get("routed_experts") is None:
        return None
    return np.frombuffer(row["routed_experts"], np.uint8).reshape(row["routed_experts_shape"])


REPLAY_COLUMNS = [
    "step", "traj_id", "group_id", "reward", "prompt_ids", "response_ids",
    "behaviour_logprobs", "versions", "loss_mask",
]  # fmt: skip


def replay_columns(run_dir: Path) -> list[str]:
    """The log columns replay reads; ``images`` and the routed experts too for a run
    that logs them."""
    import pyarrow.parquet as pq

    parts = trajectory_parts(run_dir)
    names = pq.read_schema(parts[-1]).names if parts else []
    optional = ["images", "routed_experts", "routed_experts_shape"]
    return [*REPLAY_COLUMNS, *(c for c in optional if c in names)]


def replay(run_dir: str | Path, from_step: int, steps: int) -> list[dict[str, Any]]:
    """Per replayed step: the replayed and the logged loss and grad norm."""
    from omegaconf import OmegaConf

    from asyncrl.config import compose_config
    from asyncrl.learner.batch import collate
    from asyncrl.learner.learner import Learner
    from asyncrl.wiring import prepare

    run_dir = Path(run_dir)
    batches = read_batches(run_dir, full=True)
    wanted = list(range(from_step, from_step + steps))
    absent = [s for s in wanted if s not in batches]
    if absent:
        raise ReplayError(f"steps {absent} are not in {run_dir}/trajectories/batches.jsonl")
    ckpt = checkpoint_at(run_dir, from_step)
    # a run saved before a key existed: conf/'s value fills it (as the CLI would)
    setup = prepare(OmegaConf.merge(compose_config(), OmegaConf.load(run_dir / "config.yaml")))
    cols = replay_columns(run_dir)
    by_step: dict[int, dict[str, dict]] = {}
    for r in read_trajectories(run_dir, columns=cols).to_pylist():
        if r["step"] in wanted:
            by_step.setdefault(r["step"], {})[r["traj_id"]] = r
    s, sampling = setup.learner, setup.actor.sampling
    learner = Learner(
        setup.model_path,
        setup.loss,
        setup.advantage,
        s,
        seed=setup.run.seed,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
    )
    learner.load(str(ckpt))
    out = []
    for step in wanted:
        rec = batches[step]
        if "loss/total" not in rec:
            raise ReplayError(f"step {step}: batches.jsonl has no logged loss (an older run)")
        trajs = trajectories_of(by_step, rec["traj_ids"], step, run_dir / LOG_DIR)
        m = learner.step_on_batch(collate(trajs, learner.pad_id), step)
        row = {"step": step, "trajectories": len(trajs)}
        for key, name in (("loss/total", "loss"), ("learner/grad_norm", "grad_norm")):
            row[name], row[f"logged_{name}"] = m[key], rec.get(key)
            row[f"{name}_equal"] = m[key] == rec.get(key)
        out.append(row)
    learner.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="asyncrl-replay", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--from-step", type=int, required=True, help="a step with a checkpoint")
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args(argv)
    if a.steps < 1:
        print("asyncrl-replay: --steps must be >= 1", file=sys.stderr)
        return 2
    try:
        rows = replay(a.run_dir, a.from_step, a.steps)
    except (ReplayError, FileNotFoundError) as e:
        print(f"asyncrl-replay: {e}", file=sys.stderr)
        return 2
    print(
        f"{'step':>5} {'loss (replayed)':>24} {'loss (logged)':>24} {'grad norm (replayed)':>24} "
        f"{'grad norm (logged)':>24}  equal"
    )
    for r in rows:
        eq = "yes" if r["loss_equal"] and r["grad_norm_equal"] else "NO"
        print(
            f"{r['step']:>5} {r['loss']!r:>24} {r['logged_loss']!r:>24} "
            f"{r['grad_norm']!r:>24} {r['logged_grad_norm']!r:>24}  {eq}"
        )
    equal = all(r["loss_equal"] and r["grad_norm_equal"] for r in rows)
    loss_diff = max(abs(r["loss"] - r["logged_loss"]) for r in rows)
    grad_diff = max(abs(r["grad_norm"] - r["logged_grad_norm"]) for r in rows)
    brief = {
        "steps": len(rows),
        "from_step": a.from_step,
        "bit_equal": equal,
        "max_abs_loss_diff": loss_diff,
        "max_abs_grad_norm_diff": grad_diff,
    }
    print(json.dumps(brief))
    return 0


if __name__ == "__main__":
    sys.exit(main())
