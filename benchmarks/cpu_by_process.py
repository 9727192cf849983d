"""CPU seconds by process name of a command and everything below it, sampled over time:
the per-part CPU costs benchmarks/simulate.py's 2-core host model is calibrated from.

    sample every PERIOD_S: /proc/<pid>/stat of the command's process tree
        │  utime + stime per process, summed by its name (`VLLM::Worker`,
        │  `ray::RolloutActor`, `ray::LearnerRank`, ...); a process that ended keeps
        ▼  its last reading
    out/cpu.jsonl: one line per sample {"t": unix seconds, "cpu": {name: seconds},
                   "host_busy": CPU seconds the host's processes have used (/proc/stat),
                   "host_steal": CPU seconds the hypervisor took from the host}

    python -m benchmarks.cpu_by_process --out DIR -- python -m asyncrl.train max_steps=60

Ray's workers are children of its raylet, which the command starts: they are in the tree.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

PERIOD_S = 0.5  # fine enough to cut a run's steady state at its steps' wall times
TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[str, int, float] | None:
    """(name, parent pid, CPU seconds) of a live process, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
        name = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return None
    comm = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2 :].split()
    ppid, utime, stime = int(fields[1]), int(fields[11]), int(fields[12])
    label = comm if comm.startswith(("ray::", "VLLM")) or not name else Path(name).name
    if label.startswith("python") and "cmdline" not in label:
        label = f"{label} {_module(pid)}"
    return label, ppid, (utime + stime) / TICK


def _module(pid: int) -> str:
    """The -m module or script of a Python process (the driver, Ray's own processes)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    args = [a.decode(errors="replace") for a in args if a]
    if "-m" in args and args.index("-m") + 1 < len(args):
        return args[args.index("-m") + 1]
    return Path(args[1]).name if len(args) > 1 else ""


def host_cpu() -> tuple[float, float]:
    """CPU seconds since boot that the whole host has been busy (/proc/stat's user, nice,
    system, irq and softirq), so that a run's own CPU can be set against everyone's, and
    that the hypervisor took from it (steal: a slower host hour shows there)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (f[0] + f[1] + f[2] + f[5] + f[6]) / TICK, f[7] / TICK


def tree(root: int) -> dict[int, tuple[str, float]]:
    """Every live process under ``root`` (itself included): pid -> (name, CPU s)."""
    stats = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (s := _stat(int(d))) is not None:
            stats[int(d)] = s
    keep, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        if pid in stats and pid not in keep:
            keep[pid] = (stats[pid][0], stats[pid][2])
            frontier += [p for p, s in stats.items() if s[1] == pid]
    return keep


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    args.out.mkdir(parents=True, exist_ok=True)
    seen: dict[int, tuple[str, float]] = {}
    with (args.out / "cpu.jsonl").open("w") as f:
        proc = subprocess.Popen(cmd)
        while proc.poll() is None:
            seen.update(tree(proc.pid))
            by_name: dict[str, float] = {}
            for name, cpu in seen.values():
                by_name[name] = by_name.get(name, 0.0) + cpu
            busy, steal = host_cpu()
            row = {"t": time.time(), "cpu": by_name, "host_busy": busy, "host_steal": steal}
            f.write(json.dumps(row) + "\n")
            f.flush()
            time.sleep(PERIOD_S)
    raise SystemExit(proc.returncode)


if __name__ == "__main__":
    main()
