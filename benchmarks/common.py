"""What every benchmark script shares: arguments, a local Ray on loopback, composed
configs, core pinning, tables, CSV/PNG output and the last-line JSON.

Each script runs as ``python -m benchmarks.<name> [--quick] [--out DIR]`` (or as a
file: its first lines put the repository root, not ``benchmarks/``, on ``sys.path``,
so ``benchmarks/queue.py`` cannot shadow the standard ``queue`` that Ray imports),
prints a readable table and, as its very last stdout line, one JSON object with its
figures; CSV and PNG go to ``--out`` (default ``bench_out/<name>/``).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from asyncrl.utils.affinity import pin_tree, process_tree  # noqa: F401 - the scripts' import

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK_IP = "127.0.0.2"  # local Ray binds here, never the machine's outward address


# ---- arguments and outputs --------------------------------------------------------------
def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python -m benchmarks.{name}",
        description=(doc or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="a small subset that runs in minutes")
    p.add_argument(
        "--out", type=Path, default=ROOT / "bench_out" / name, help="CSV/PNG output directory"
    )
    return p


def probe_args(p: argparse.ArgumentParser, max_tokens: int, what: str) -> argparse.Namespace:
    """The flags the probes (benchmarks/tool_probe.py, task_probe.py) share, added to ``p``
    after its own, parsed; ``--quick``: 8 prompts of 4 samples. ``what``: one sample."""
    p.add_argument("--model", default="smollm2", help="a conf/model preset")
    p.add_argument("--prompts", type=int, default=48, help="held-out prompts")
    p.add_argument("--samples", type=int, default=8, help=f"sampled {what}s per prompt")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=max_tokens, help=f"tokens per {what}")
    p.add_argument("--dtype", default="bfloat16", help="actor.engine.dtype")
    p.add_argument("overrides", nargs="*", help="config overrides")
    args = p.parse_args()
    if args.quick:
        args.prompts, args.samples = 8, 4
    return args


def print_table(title: str, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """A plain aligned text table on stdout."""
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    line = "  ".join("-" * w for w in widths)
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print(line)
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    print(flush=True)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    return str(v)


def write_csv(
    path: Path, rows: list[dict[str, Any]], fingerprint: dict[str, Any] | None = None
) -> Path:
    """``fingerprint`` (the measuring run's, :func:`run_fingerprint`): its :data:`FP_COLUMNS`
    become columns of every row that lacks them, and the whole of it is written to
    ``fingerprint.json`` beside the CSV."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fingerprint is not None:
        rows = stamp(rows, fingerprint)
        (path.parent / "fingerprint.json").write_text(json.dumps(fingerprint, indent=2))
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return path


# What every measured row carries of its run's fingerprint (asyncrl/utils/fingerprint.py;
# docs/reproducibility.md): enough to tell a different model, config, code or machine.
FP_COLUMNS = ("model_weights_sha256", "config_sha256", "seed", "git_commit", "git_dirty",
              "versions_torch", "versions_vllm", "hardware_cpu", "hardware_cpu_id",
              "hardware_torch_cpu_capability", "hardware_gpu")  # fmt: skip


def run_fingerprint(
    cfg: Any = None, model_path: Path | str | None = None, seed: int | None = None
) -> dict[str, Any]:
    """The fingerprint of a benchmark run (no cfg or model: code, versions, hardware)."""
    from asyncrl.models.shipped import WEIGHTS_SHA256
    from asyncrl.utils.fingerprint import fingerprint

    return fingerprint(cfg, model_path, seed, WEIGHTS_SHA256)


def fingerprint_columns(fp: dict[str, Any]) -> dict[str, Any]:
    """``fp_<field>`` for each of :data:`FP_COLUMNS`."""
    from asyncrl.utils.fingerprint import flat

    cols = flat(fp)
    return {f"fp_{k}": cols.get(f"fp_{k}") for k in FP_COLUMNS}


def stamp(rows: list[dict[str, Any]], fp: dict[str, Any]) -> list[dict[str, Any]]:
    """``rows`` with the fingerprint's columns (a column a row already has stays)."""
    cols = fingerprint_columns(fp)
    return [{**r, **{k: v for k, v in cols.items() if k not in r}} for r in rows]


def pyplot():
    """matplotlib's pyplot on the file-only backend (no display here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def finite_or_none(obj: Any) -> Any:
    """JSON has no NaN/inf: a figure that could not be measured becomes null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite_or_none(v) for v in obj]
    return obj


def emit_json(figures: dict[str, Any]) -> None:
    """The script's figures as the very last stdout line (call it after Ray is down:
    Ray forwards worker output to stdout)."""
    sys.stderr.flush()
    sys.stdout.flush()
    print(json.dumps(finite_or_none(figures), allow_nan=False), flush=True)


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


# ---- Ray and configs ----------------------------------------------------------------------
def start_ray(num_cpus: int | None = None, env: dict[str, str] | None = None) -> None:
    """A local Ray on loopback for this process; workers import ``asyncrl`` and
    ``benchmarks`` from this checkout. ``env`` goes to every worker (e.g. vLLM's
    OMP binding)."""
    import logging

    import ray

    env_vars = {
        "PYTHONPATH": os.pathsep.join(
            p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p
        ),
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "TOKENIZERS_PARALLELISM": "false",
        **(env or {}),
    }
    ray.init(
        _node_ip_address=LOOPBACK_IP,
        num_cpus=num_cpus,
        include_dashboard=False,
        runtime_env={"env_vars": env_vars},
        logging_level=logging.WARNING,
    )


def host() -> str:
    """The CPU's model name and core count (what a benchmark's figures were measured on)."""
    import platform

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        name = next(x.split(":", 1)[1].strip() for x in lines if x.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    return f"{name}, {os.cpu_count()} cores"


def compose(*overrides: str):
    """The training config (``conf/config.yaml``) with Hydra overrides, as the CLI
    would build it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return hydra_compose("config", overrides=list(overrides))


class Recorder:
    """Stands in for ``asyncrl.utils.runlog.Scalars`` in ``asyncrl.loop.run_loop``: keeps every
    step's metrics in memory instead of writing TensorBoard events."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.last: dict[str, float] = {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
        row["step"] = float(step)
        self.steps.append(row)
        self.last.update(row)

    def close(self) -> None:
        pass


class InStartOrder:
    """The queue, but each batch in the order the actor started its groups (their ids
    lead with it, actor/episode.py), not in the order they reached the queue: the
    learner sums in batch order, and the arrival order follows timing. With it and the
    groups' own sampling seeds a run is deterministic (docs/reproducibility.md)."""

    def __init__(self, queue: Any):
        self._queue = queue
        self.get_batch = self  # get_batch.remote(...) is self.remote(...)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)

    def remote(self, *args: Any) -> Any:
        import ray

        items = ray.get(self._queue.get_batch.remote(*args))
        return ray.put(None if items is None else sorted(items, key=lambda i: i.group_id))


# ---- pinning --------------------------------------------------------------------------------
def _getpid(_actor_self: Any) -> int:
    return os.getpid()


def actor_pid(handle: Any) -> int:
    """The OS process id behind a Ray actor handle."""
    import ray

    return int(ray.get(handle.__ray_call__.remote(_getpid)))


# ---- parts ---------------------------------------------------------------------------------
def stop_all(parts: Any) -> tuple[dict, dict]:
    """``asyncrl.wiring.stop_parts`` and then free everything it leaves to
    ``ray.shutdown`` (actor processes, the broker, the queue), so that the next run in
    this process finds its CPUs free. Returns (queue stats, actor stats)."""
    import ray

    from asyncrl.wiring import stop_parts

    actors = list(parts.actors.values())
    try:
        queue_stats, actor_stats = stop_parts(parts, quiet=True)  # closes the broker too
    finally:
        for handle in [*actors, parts.queue]:
            ray.kill(handle)
    return queue_stats, actor_stats


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
