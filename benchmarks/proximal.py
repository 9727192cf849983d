"""Learner step time with the proximal forward pass and without it.

    python benchmarks/proximal.py [--model medium] [--steps 12] [--minibatches 1]

Decoupled PPO with ``loss.proximal=recompute`` (the learner recomputes the batch's
proximal log-probs with a forward pass before the first optimizer step) against
``loss.proximal=loglinear`` (AReaL's approximation from the tokens' versions: no such
pass), on the default-sized batches of ``benchmarks/learner.py`` (16 groups x 8
addition-task samples, random Qwen2 weights). Steps alternate between the two learners,
so load from other processes hits both; reported per mode: the fastest and the median
wall time of a step and its median CPU seconds (one torch thread: all of the work, and
not inflated by other processes). Step 0 of each warms up and is dropped. The last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]

import torch  # noqa: E402

from asyncrl.learner.batch import collate  # noqa: E402
from asyncrl.learner.config import LearnerSettings  # noqa: E402
from asyncrl.learner.learner import Learner  # noqa: E402
from asyncrl.losses.advantages import GroupNormalized  # noqa: E402
from asyncrl.losses.decoupled_ppo import DecoupledPPOLoss  # noqa: E402
from benchmarks.learner import MODELS, make_batch, make_model  # noqa: E402

MODES = ("recompute", "loglinear")


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="medium", choices=list(MODELS))
    ap.add_argument("--steps", type=int, default=12, help="measured steps per mode")
    ap.add_argument("--minibatches", type=int, default=1, help="learner.minibatches")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(args.model, Path(tmp))
        settings = LearnerSettings.defaults(
            optim={"lr": 1e-4}, num_threads=1, minibatches=args.minibatches
        )
        learners = {
            m: Learner(str(model_dir), DecoupledPPOLoss(proximal=m), GroupNormalized(), settings)
            for m in MODES
        }
        wall: dict[str, list[float]] = {m: [] for m in MODES}
        cpu: dict[str, list[float]] = {m: [] for m in MODES}
        for i in range(args.steps + 1):
            for m in MODES:
                batch = collate(make_batch(seed=i))
                c0, t0 = time.thread_time(), time.perf_counter()
                learners[m].step_on_batch(batch, i)
                c1, t1 = time.thread_time(), time.perf_counter()
                if i:
                    wall[m].append(t1 - t0)
                    cpu[m].append(c1 - c0)
    out = {
        m: {
            "best_step_s": round(min(wall[m]), 4),
            "median_step_s": round(statistics.median(wall[m]), 4),
            "median_cpu_s": round(statistics.median(cpu[m]), 4),
        }
        for m in MODES
    }
    for key in ("best_step_s", "median_step_s", "median_cpu_s"):
        out[f"loglinear_saving_{key}"] = round(1 - out["loglinear"][key] / out["recompute"][key], 3)
    out.update(model=args.model, steps=args.steps, minibatches=args.minibatches,
               cpu_capability=torch.backends.cpu.get_cpu_capability())  # fmt: skip
    for m in MODES:
        print(f"{m:>9}: {out[m]}", file=sys.stderr)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
