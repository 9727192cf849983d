"""Ray for a run (joined or started on loopback, its CPUs checked) and the driver's
SIGINT/SIGTERM handling. The running parts themselves: asyncrl/parts.py."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from asyncrl.cluster.ship import ShipCode
from asyncrl.config import TIMEOUT_S, ConfigError, Settings, check_ray_address, setting

log = logging.getLogger(__name__)


@dataclass
class RaySettings(Settings):
    """``ray.*`` in config (conf/config.yaml holds every value)."""

    KEY = "ray"

    address: str | None = setting()  # null: a local Ray; "auto" or host:port joins a cluster
    num_cpus: int | None = setting(">= 1")  # local Ray only; null = all cores
    node_ip: str = setting()  # a local Ray binds here; 127.0.0.1: loopback only (docs/security.md)
    connect_timeout_s: float = setting(TIMEOUT_S)
    ship_code: ShipCode = setting()  # asyncrl/cluster/ship.py


def init_ray(ray_cfg: RaySettings) -> bool:
    """Join ``ray.address`` or start a local Ray on loopback; True if we started it."""
    import ray

    from asyncrl.cluster.ship import code_runtime_env  # noqa: I001

    env = {
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    if ray.is_initialized():
        return False
    from asyncrl.utils import watchdog

    # Every process of the run carries the mark: the watchdog kills them when we exit.
    env[watchdog.MARK] = watchdog.start()
    # Ray workers do not inherit the driver's sys.path: asyncrl and a user's loss or task
    # module next to where they launched must import there too (asyncrl/cluster/ship.py).
    ship = ShipCode(ray_cfg.ship_code)
    runtime_env = code_runtime_env(ship, joined=bool(ray_cfg.address), env_vars=env)
    if ray_cfg.address:
        check_ray_address(str(ray_cfg.address), ray_cfg.connect_timeout_s)
        try:
            ray.init(
                address=ray_cfg.address,
                runtime_env=runtime_env,
                logging_level=logging.WARNING,
            )
        except ConnectionError as e:
            raise ConfigError(f"ray.address={ray_cfg.address}: cannot join ({e})") from e
        from asyncrl.storage.sink import start_sink

        start_sink()  # learner ranks on other nodes send their files through it
        return True
    from asyncrl.storage.sink import forget_sink

    forget_sink()  # one node, the driver's files: ranks write in place
    if ray_cfg.node_ip == LOOPBACK:
        _keep_loopback()
    with _sigint_ignored_by_children():
        ray.init(
            _node_ip_address=ray_cfg.node_ip,
            num_cpus=ray_cfg.num_cpus,
            include_dashboard=False,
            runtime_env=runtime_env,
            logging_level=logging.WARNING,
            log_to_driver=True,
        )
    return True


@contextlib.contextmanager
def _sigint_ignored_by_children() -> Iterator[None]:
    """Ray's GCS, raylet and agents start in the driver's process group, so a terminal's
    Ctrl-C would reach them too and kill the run under the driver's clean stop. An ignored
    signal stays ignored across exec: started meanwhile, they ignore SIGINT for good (the
    watchdog and ray.shutdown still end them)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


# Ray's servers (GCS, raylet, every worker's gRPC port, the agents and their metrics
# exporters) listen on loopback only when the node's address is exactly this one; any
# other address, 127.0.0.2 included, makes them listen on every interface (docs/security.md).
LOOPBACK = "127.0.0.1"


def _keep_loopback() -> None:
    """``ray.init`` replaces 127.0.0.1 by the machine's outward address (so that other
    nodes could join), which makes every server listen on all interfaces. A local Ray
    never has other nodes: keep the loopback address (Ray 2.60's
    ``services.resolve_ip_for_localhost``; the socket check of tests/test_sockets.py,
    run in the SIGINT test, fails if this stops binding loopback)."""
    from ray._private import services

    if not getattr(services.resolve_ip_for_localhost, "_asyncrl", False):

        def keep(host: str) -> str:
            return host

        keep._asyncrl = True  # type: ignore[attr-defined]
        services.resolve_ip_for_localhost = keep


def check_resources(needed: dict[str, float]) -> None:
    """Fail at start-up, with the numbers, when the cluster cannot hold the parts."""
    import ray

    _compare(needed, ray.cluster_resources().get("CPU", 0.0), "the cluster", "or add nodes")


def check_local_cpus(needed: dict[str, float], ray_settings: RaySettings) -> None:
    """The same check before a local Ray starts, against the CPUs it will have
    (``ray.num_cpus``, or what Ray detects: cores, cgroup limits). A cluster
    (``ray.address``) is checked once joined."""
    import ray

    if ray_settings.address or ray.is_initialized():  # joined, not started: checked later
        return
    if ray_settings.num_cpus is not None:
        have, where = float(ray_settings.num_cpus), f"ray.num_cpus={ray_settings.num_cpus}"
    else:
        from ray._private.utils import get_num_cpus

        have, where = float(get_num_cpus()), "this machine"
    _compare(needed, have, where, "or raise ray.num_cpus")


def _compare(needed: dict[str, float], have: float, where: str, more: str) -> None:
    want = sum(needed.values())
    if want > have:
        parts = ", ".join(f"{k}: {v:g}" for k, v in needed.items() if v)
        raise ConfigError(
            f"the run needs {want:g} Ray CPUs ({parts}) but {where} has {have:g}; lower "
            f"actor.num_actors / learner.world_size or their num_cpus, {more}"
        )


class Interrupted(Exception):
    """SIGINT/SIGTERM where the run cannot stop cleanly: before its first step, or a
    second signal. ``signame``: which."""

    def __init__(self, signame: str, during: str):
        super().__init__(f"{signame} {during}")
        self.signame, self.during = signame, during


class GracefulStop:
    """SIGINT / SIGTERM of the driver. While ``deferring`` (the loop and its final
    checkpoint and summary), the first signal only asks the loop to stop after the step
    in progress (``requested()``), so that everything is written; before that, or a
    second signal, raises :class:`Interrupted` at once (parts stopped in ``finally``)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signame: str | None = None
        self.deferring = False
        self._old: dict[int, Any] = {}

    def install(self) -> None:
        """Also after ``ray.init``, which may set handlers of its own. Main thread only."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.SIGNALS:
            old = signal.signal(sig, self._on)
            self._old.setdefault(sig, old)

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def requested(self) -> bool:
        return self.signame is not None

    def _on(self, signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.deferring and self.signame is None:
            self.signame = name
            return
        first = self.signame is None
        self.signame = self.signame or name
        raise Interrupted(name, "during start-up" if first else "a second time")
