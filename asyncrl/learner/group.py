"""LearnerGroup: N learner ranks on Ray, called like one learner.

    driver ──group.submit_train_step(items, V)──▶ rank 0 … rank N-1 (same call, same args)
                 ◀── rank 0's ObjectRef ──────── rank 0 gathers every rank's metrics
    ranks: one Ray actor each, one bundle each of a placement group (PACK), one
           torch.distributed group (gloo on CPU, NCCL on GPU) rendezvousing at an address
           the driver picks (127.0.0.1 and a free port when the group sits on its node)

Every method calls every rank (the ranks' collectives must line up) and returns rank 0's
value, raising the first rank's error as soon as any rank fails. ``submit_train_step``
alone returns at once (rank 0's ref): a peer that fails there surfaces as rank 0's
collective timing out (``learner.collective_timeout_s``) or at the next call.
``group.ranks`` are the rank actors: the brokers call the weight methods of
:class:`~asyncrl.learner.weights.WeightsOut` on them (each rank forwards them to the
``WeightsOut`` it holds).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

from asyncrl.config import ConfigError
from asyncrl.learner.config import LearnerSettings, check_cluster_has

PLACEMENT_TIMEOUT_S = 60.0  # a placement group not ready by then will not become ready
CALL_TIMEOUT_S = 3600.0  # waiting on every rank (save, load, ping): generous, not forever
STREAM_BACKPRESSURE = 4  # weight tensors buffered ahead of the consumer, per stream


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _remote_rendezvous() -> str:
    import ray

    ip = ray.util.get_node_ip_address()
    return f"{ip}:{free_port(ip)}"


def wait_all(refs: list, timeout_s: float = CALL_TIMEOUT_S) -> list:
    """Every ref's value; raises the first error as soon as it is known."""
    import ray

    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=timeout_s)
        if not ready:
            raise TimeoutError(f"learner ranks did not answer within {timeout_s:g} s")
        ray.get(ready)  # raises a rank's exception at once
    return ray.get(refs)


def check_fits(world_size: int, num_cpus: float, num_gpus: float) -> None:
    """Fail at once, with the numbers, when the cluster can never hold the ranks."""
    import ray

    have = ray.cluster_resources()
    cpu, gpu = have.get("CPU", 0.0), have.get("GPU", 0.0)
    if world_size * num_cpus > cpu or world_size * num_gpus > gpu:
        raise ConfigError(
            f"learner.world_size={world_size} ranks x (learner.num_cpus={num_cpus:g}, "
            f"learner.num_gpus={num_gpus:g}) need {world_size * num_cpus:g} CPUs and "
            f"{world_size * num_gpus:g} GPUs; the Ray cluster has {cpu:g} CPUs and {gpu:g} GPUs. "
            f"Lower learner.world_size or the per-rank resources, or add nodes"
        )


class LearnerGroup:
    def __init__(
        self,
        model_path: str,
        loss: Any,
        advantage: Any,
        settings: LearnerSettings,
        trajectory_log: str | None = None,
        **rank_kwargs: Any,
    ):
        """``rank_kwargs``: the rest of :class:`~asyncrl.learner.learner.Learner`'s
        keywords (sampling temperature / top_k / top_p, seed)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from asyncrl.broker.messages import CONCURRENCY_GROUPS
        from asyncrl.learner.rank import LearnerRank

        world_size, num_cpus, num_gpus = settings.world_size, settings.num_cpus, settings.num_gpus
        self.world_size = world_size
        self._inflight: list = []
        check_fits(world_size, num_cpus, num_gpus)
        bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {}), **settings.resources}
        self.pg = placement_group([bundle] * world_size, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self.pg)
            raise ConfigError(
                f"learner.world_size={world_size} ranks x {bundle} do not fit: the cluster has "
                f"{ray.cluster_resources()} in all, {ray.available_resources()} free; lower "
                f"learner.world_size / learner.num_cpus / learner.num_gpus"
            ) from None
        rendezvous = self._rendezvous() if world_size > 1 or num_gpus else None
        self.rendezvous = rendezvous  # rank 0's store: host:port (None: a single CPU rank)
        # rank 0's weight transfers run in their own thread (learner/weights.py)
        cls = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(LearnerRank)
        self.ranks = [
            cls.options(
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                resources=dict(settings.resources) or None,  # learner.resources: placement
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=r
                ),
            ).remote(
                model_path,
                loss,
                advantage,
                settings,
                rank=r,
                rendezvous=rendezvous,
                trajectory_log=trajectory_log,  # rank 0 writes; the others know it does
                **rank_kwargs,
            )  # fmt: skip
            for r in range(world_size)
        ]

    # ---- what the driver calls --------------------------------------------------------
    def submit_train_step(self, items: list, version: int) -> Any:
        """Start one step on every rank; rank 0's ObjectRef (its metrics dict)."""
        refs = self._submit("train_step", items, version)
        self._inflight = refs[1:]
        return refs[0]

    def train_step(self, items: list, version: int) -> dict[str, float]:
        return self._call("train_step", items, version)

    def step_on_batch(self, batch: Any, version: int) -> dict[str, float]:
        """One step on a collated batch every rank gets whole (benchmarks/learner.py)."""
        return self._call("step_on_batch", batch, version)

    def save(self, path: str, driver_state: dict | None = None) -> str:
        return self._call("save", path, driver_state)

    def load(self, path: str) -> dict[str, Any]:
        return self._call("load", path)

    def ping(self) -> bool:
        """Every rank has loaded its model."""
        return self._call("ping")

    def logprobs_of(self, trajs: list) -> list:
        return self._call("logprobs_of", trajs)

    def weight_digests(self) -> dict[str, str]:
        return self._call("weight_digests")

    def full_state_dict(self) -> dict[str, Any]:
        """Rank 0's full weights, fetched one tensor at a time (bit-exactness checks)."""
        return dict(self.named_parameters_stream())

    def _submit(self, method: str, *args: Any) -> list:
        self._check_inflight()
        return [getattr(r, method).remote(*args) for r in self.ranks]

    def _call(self, method: str, *args: Any) -> Any:
        return wait_all(self._submit(method, *args))[0]

    def _rendezvous(self) -> str:
        """``host:port`` for rank 0's store: loopback when rank 0 shares the driver's node."""
        import ray
        from ray.util.placement_group import placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        node0 = placement_group_table(self.pg)["bundles_to_node_id"][0]
        if node0 == ray.get_runtime_context().get_node_id():
            return f"127.0.0.1:{free_port()}"
        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=0)
        task = ray.remote(_remote_rendezvous).options(num_cpus=0, scheduling_strategy=strategy)
        return ray.get(task.remote(), timeout=PLACEMENT_TIMEOUT_S)

    def _check_inflight(self) -> None:
        """Raise the error of a peer rank from an earlier hot-path call, if any."""
        import ray

        if self._inflight:
            done, _ = ray.wait(self._inflight, num_returns=len(self._inflight), timeout=0)
            ray.get(done)
            self._inflight = [r for r in self._inflight if r not in done]

    def named_parameters_stream(self) -> Iterator[tuple[str, Any]]:
        """``(HF name, full CPU tensor)`` from rank 0, produced one FSDP unit at a time with
        at most ``STREAM_BACKPRESSURE`` tensors in flight."""
        import ray

        gens = [
            r.stream_weights.options(
                num_returns="streaming", _generator_backpressure_num_objects=STREAM_BACKPRESSURE
            ).remote()
            for r in self.ranks
        ]
        for ref in gens[0]:
            yield ray.get(ref)
        for g in gens[1:]:
            for ref in g:
                ray.get(ref)

    def close(self, timeout_s: float = 60.0) -> None:
        """Close every rank, then free the actors and the placement group (twice is
        harmless)."""
        import ray

        try:
            if self.ranks:
                wait_all([r.close.remote() for r in self.ranks], timeout_s)
        finally:
            for r in self.ranks:
                ray.kill(r)
            self.ranks = []
            if self.pg is not None:
                ray.util.remove_placement_group(self.pg)
                self.pg = None


def start_learner(
    settings: LearnerSettings,
    model_path: str,
    loss: Any,
    advantage: Any,
    sampling: Any,
    seed: int,
    max_steps: int,
    trajectory_log: str | None,
) -> LearnerGroup:
    """The :class:`LearnerGroup` of ``settings`` (the ranks load the model in the
    background; ``group.ping()`` waits for them). ``sampling``: the actors' sampling
    settings, whose temperature / top-k / top-p the log-probs follow; ``max_steps`` is
    already in ``settings.optim.total_steps``."""
    del max_steps  # from_config folded it into the LR schedule
    check_cluster_has("learner.resources", settings.resources, settings.world_size)
    return LearnerGroup(
        model_path,
        loss,
        advantage,
        settings,
        trajectory_log=trajectory_log,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        seed=seed,
    )
