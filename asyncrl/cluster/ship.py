"""How the run's code reaches Ray's workers (``ray.ship_code``).

    local Ray, auto | never ──▶ env_vars PYTHONPATH = the driver's cwd + its PYTHONPATH +
                                sys.path[:3]: same machine, nothing uploaded, start-up as
                                fast as ever
    ray.address, auto | always ──▶ py_modules = [the asyncrl package]
                                   working_dir = the driver's cwd (a user's loss, task or
                                   reward module), less EXCLUDES and .gitignore'd paths
      Ray zips both once per job into the GCS; every node unpacks them and puts them first
      on its workers' PYTHONPATH (and so on that of the processes they start: vLLM's
      engine core imports our worker extension from there).

``never`` on a cluster assumes every node has the driver's paths (a shared filesystem
and venv); ``always`` on a local Ray exercises the cluster path on one machine.
"""

from __future__ import annotations

import enum
import os
import sys
from pathlib import Path
from typing import Any

from asyncrl.config import ConfigError

# Never uploaded from the working dir: dotfiles and dot-directories (.git, .venv, .ssh,
# .env, credentials of every tool), key material, virtual environments, run outputs,
# caches (the tiny model's cache alone can be hundreds of MB; models are read from
# model.path, which every node must have). Patterns as in .gitignore, relative to the cwd
# (".?*", not ".*": Ray also matches the working dir itself, as ".").
EXCLUDES = [
    ".?*", "venv", "outputs", "multirun", "__pycache__", "*.pyc", "*.egg-info", "bench_out",
    "*.parquet", "*.safetensors", "*.pem", "*.key", "*.p12", "*.pfx", "id_rsa*", "id_ecdsa*",
    "id_ed25519*", "*.kdbx", "credentials*",
]  # fmt: skip
# set in a shipped job's workers: the working dir's conf/ is the run's configs
SHIPPED_ENV = "ASYNCRL_SHIPPED"


class ShipCode(enum.StrEnum):
    """How the run's code reaches Ray's workers (``ray.ship_code``)."""

    AUTO = "auto"  # a joined cluster (ray.address): ship; a local Ray: the driver's paths
    ALWAYS = "always"  # ship through runtime_env (py_modules + working_dir) in any case
    NEVER = "never"  # the driver's paths as PYTHONPATH: every node must have them


def package_dir() -> Path:
    import asyncrl

    return Path(asyncrl.__file__).resolve().parent


def check_working_dir(cwd: Path) -> None:
    """Refuse to ship a home directory or the filesystem root as the job's working dir:
    everything under it not excluded would reach every node of the cluster."""
    if cwd == Path(cwd.anchor) or cwd == Path.home().resolve():
        raise ConfigError(
            f"ray.ship_code: the working directory {cwd} is a home directory or the "
            "filesystem root, and would be shipped to every node; run from a project "
            "directory (the one holding your loss, task or reward modules), or set "
            "ray.ship_code=never on a cluster that shares the driver's files"
        )


def code_runtime_env(ship: ShipCode, joined: bool, env_vars: dict[str, str]) -> dict[str, Any]:
    """The job's ``runtime_env``: ``env_vars`` plus the code, shipped or by path."""
    env = dict(env_vars)
    if ship is ShipCode.NEVER or (ship is ShipCode.AUTO and not joined):
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in [os.getcwd(), os.environ.get("PYTHONPATH", ""), *sys.path[:3]] if p
        )
        return {"env_vars": env}
    cwd, pkg = Path.cwd().resolve(), package_dir()
    check_working_dir(cwd)
    env[SHIPPED_ENV] = "1"
    excludes = list(EXCLUDES)
    if pkg.parent == cwd:  # run from a checkout: asyncrl/ ships once, as the py_module
        excludes.append(f"/{pkg.name}")
    return {
        "env_vars": env,
        "py_modules": [str(pkg)],
        "working_dir": str(cwd),
        "excludes": excludes,
    }
