"""``asyncrl-train``: wire the parts, run the loop, write the outputs.

    actors ──(refs)──▶ queue ──get_batch──▶ driver ──train_step(refs)──▶ learner
       ▲                                                                   │
       └────────────── broker.publish(version, weights ref) ◀──────────────┘

The driver only passes references and small metadata; trajectories go from the
actor's ``ray.put`` straight to the learner's ``ray.get``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from asyncrl.config import ConfigError
from asyncrl.learner.resume import resume, save_checkpoint
from asyncrl.runtime import Parts, check_resources, init_ray
from asyncrl.utils.runlog import Scalars
from asyncrl.wiring import Setup, prepare, start_parts, stop_parts

log = logging.getLogger("asyncrl")


class RunError(RuntimeError):
    pass


def wait_batch(parts: Parts, cfg: DictConfig, version: int) -> list:
    """A batch from the queue; raises (with every actor's state) instead of hanging."""
    import ray

    deadline = time.time() + cfg.replay.wait_timeout_s
    while True:
        items = ray.get(parts.queue.get_batch.remote(cfg.learner.batch_groups, version, 5.0))
        if items:
            return items
        states = actor_states(parts)
        alive = [n for n, s in states.items() if isinstance(s, dict) and not s.get("fatal")]
        if not alive or time.time() > deadline:
            why = (
                "no actor is alive"
                if not alive
                else f"no batch within replay.wait_timeout_s={cfg.replay.wait_timeout_s}"
            )
            raise RunError(f"{why}; queue: {ray.get(parts.queue.stats.remote())}; actors: {states}")


def actor_states(parts: Parts) -> dict[str, Any]:
    import ray

    out: dict[str, Any] = {}
    for name, a in parts.actors.items():
        try:
            out[name] = ray.get(a.get_stats.remote(), timeout=10)
        except Exception as e:  # a dead or stuck actor is reported, not raised
            out[name] = f"unreachable: {type(e).__name__}: {e}"
    return out


def train_loop(
    cfg: DictConfig, parts: Parts, scalars: Scalars, version: int = 0, ckpt: Path | None = None
) -> dict[str, Any]:
    import ray
    from tqdm import tqdm

    t0, first = time.time(), version
    per_step: list[tuple[float, float]] = []  # (reward sum, count) per step
    tokens_trained = 0
    wait_s = train_s = 0.0
    bar = tqdm(
        total=cfg.max_steps, initial=first, disable=not cfg.progress, dynamic_ncols=True,
        file=sys.stderr,
    )  # fmt: skip
    for _ in range(cfg.max_steps - first):  # a resumed run continues up to max_steps
        t = time.time()
        items = wait_batch(parts, cfg, version)
        wait_s += time.time() - t
        t = time.time()
        m = ray.get(parts.learner.train_step.remote(items, version))
        train_s += time.time() - t
        version += 1
        # the object-store broker ships a ray.put copy; the process-group broker streams
        # the weights out of learner rank 0 itself, so nothing is fetched here
        weights = (
            ray.get(parts.learner.state_dict_ref.remote())
            if cfg.broker.kind == "objectstore"
            else None
        )
        m.update(parts.broker.publish(version, weights, nbytes=m.pop("weights_bytes", 0)))
        parts.queue.set_learner_version.remote(version)
        per_step.append((m["reward/sum"], m["reward/count"]))
        tokens_trained += int(m["tokens/trained"])
        m.update(progress_metrics(parts, version, t0, tokens_trained, wait_s, train_s))
        scalars.log(version, m)
        every = cfg.learner.checkpoint_every
        if ckpt is not None and every and version % every == 0:
            save_checkpoint(parts, ckpt)
        bar.update(1)
        bar.set_postfix_str(
            f"reward {m['reward/mean']:.3f} stale {m['staleness/mean']:.2f}/{int(m['staleness/max'])} "
            f"tok/s {m.get('perf/tokens_per_s_generated', 0):.0f}"
        )
    bar.close()
    parts.broker.wait()
    return {
        "steps": len(per_step),
        "policy_version": version,
        "per_step": per_step,
        "tokens_trained": tokens_trained,
    }


def progress_metrics(
    parts: Parts, version: int, t0: float, tokens_trained: int, wait_s: float, train_s: float
) -> dict[str, float]:
    import ray

    q = ray.get(parts.queue.stats.remote())
    states = [s for s in actor_states(parts).values() if isinstance(s, dict)]
    wall = max(time.time() - t0, 1e-9)
    gen = sum(s["tokens"] for s in states)
    idle = [s["idle_seconds"] / max(time.time() - s["started"], 1e-9) for s in states]
    return {
        "replay/depth": q["depth_groups"],
        "replay/produced": q["produced"],
        "replay/in_flight": q["in_flight"],
        "staleness/dropped": q["dropped_stale"],
        "staleness/max_trained": q["max_staleness_trained"],
        "perf/tokens_per_s_generated": gen / wall,
        "perf/tokens_per_s_trained": tokens_trained / wall,
        "perf/learner_idle_frac": wait_s / wall,
        "perf/learner_busy_frac": train_s / wall,
        "perf/actor_idle_frac": sum(idle) / max(len(idle), 1),
    }


def summarise(
    cfg: DictConfig, loop: dict[str, Any], queue_stats: dict, actor_stats: dict, wall: float
) -> dict[str, Any]:
    per = loop["per_step"]
    k = max(1, len(per) // 10)

    def mean(rows):
        n = sum(c for _, c in rows)
        return sum(s for s, _ in rows) / n if n else float("nan")

    return {
        "steps": loop["steps"],
        "policy_version": loop["policy_version"],
        "reward_mean_first": mean(per[:k]),
        "reward_mean_last": mean(per[-k:]),
        "trajectories_produced": queue_stats["produced"],
        "trajectories_trained": queue_stats["trained"],
        "trajectories_dropped_stale": queue_stats["dropped_stale"],
        "trajectories_in_flight": queue_stats["in_flight"],
        "max_staleness_trained": queue_stats["max_staleness_trained"],
        "max_staleness_bound": cfg.replay.max_staleness,
        "staleness_histogram": {
            str(k): v for k, v in sorted(queue_stats["staleness_hist"].items())
        },
        "tokens_generated": sum(
            s.get("tokens", 0) for s in actor_stats.values() if isinstance(s, dict)
        ),
        "tokens_trained": loop["tokens_trained"],
        "wall_seconds": round(wall, 2),
        "actors": actor_stats,
    }


def run(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    t0 = time.time()
    setup: Setup = prepare(cfg)  # every config error surfaces here, before Ray starts
    if cfg.replay.delay_versions:
        raise ConfigError(
            f"replay.delay_versions={cfg.replay.delay_versions} is the staleness benchmark's "
            "mode: it needs generation in lock-step with the learner, which "
            "benchmarks/staleness.py drives; this training loop would wait for groups the "
            "staleness window never lets the actors make. Use replay.max_staleness to bound "
            "staleness here."
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    started = init_ray(cfg.ray)
    parts = None
    scalars = Scalars(out_dir / "tb")
    try:
        check_resources(setup.resources)
        parts = start_parts(cfg, setup, out_dir, started)
        version = resume(parts, cfg.resume) if cfg.resume else 0
        loop = train_loop(cfg, parts, scalars, version, out_dir / "checkpoint")
        save_checkpoint(parts, out_dir / "checkpoint")  # with the queue and sampler state
        queue_stats, actor_stats = stop_parts(parts, None)
        parts = None
        summary = summarise(cfg, loop, queue_stats, actor_stats, time.time() - t0)
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary
    finally:
        scalars.close()
        if parts is not None:
            stop_parts(parts, None, quiet=True)
        if started:
            import ray

            ray.shutdown()


# An absolute path: relative, Hydra looks for a module named ``conf``, which only
# ``python -m`` from the repository root finds, not the ``asyncrl-train`` script.
CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        summary = run(cfg, out_dir)
    except ConfigError as e:
        print(f"asyncrl: config error: {e}", file=sys.stderr)
        sys.exit(2)
    except RunError as e:
        print(f"asyncrl: run failed: {e}", file=sys.stderr)
        sys.exit(3)
    brief = {k: v for k, v in summary.items() if k not in ("actors", "staleness_histogram")}
    print(json.dumps(brief, indent=2))
    print(f"outputs: {out_dir}", file=sys.stderr)


if __name__ == "__main__":  # vLLM spawns processes: entry points need the guard
    main()
