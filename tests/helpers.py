"""Helpers shared by several test modules (import as ``from helpers import ...``: pytest
puts ``tests/`` on ``sys.path``, the folder has no ``__init__.py``)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from asyncrl.models.tiny import random_qwen2
from asyncrl.trajectory import Trajectory


def build_tiny_qwen(d, tie: bool = True):
    """A random Qwen2 (hidden 64, 2 layers, 2 heads, vocab 20) saved in HF format at ``d``
    (the learner tests share it)."""
    random_qwen2(20, 64, 2, 2, 1, 96, tie=tie, out_dir=d, pad_token_id=0)
    return d


def trajs(n: int, seed: int = 0, max_prompt: int = 6, max_response: int = 7) -> list[Trajectory]:
    """``n`` random trajectories over the tiny model's vocabulary, four to a group."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, r = int(rng.integers(2, max_prompt)), int(rng.integers(1, max_response))
        out.append(
            Trajectory(
                f"t{i}",
                f"g{i // 4}",
                rng.integers(1, 20, p),
                rng.integers(1, 20, r),
                -rng.random(r).astype(np.float32),
                np.zeros(r, np.int32),
                np.ones(r, bool),
                float(rng.random() < 0.5),
            )
        )
    return out


@contextlib.asynccontextmanager
async def engine_actor(model, task, settings, name: str = "t0", env=None):
    """A RolloutActor with a real vLLM-CPU engine started in-process (no Ray, a NoQueue,
    no generate loop) and its episode runner (``env``: the multi-turn one, None: the
    single-turn one), its weights labelled version 0 as the actor does. The engine is
    shut down on exit. The vLLM tests share one per module (a start costs ~25-60 s)."""
    from controlled_actor import NoQueue

    from asyncrl.actor.env_runner import make_runner
    from asyncrl.actor.rollout import RolloutActor
    from asyncrl.engine.vllm_engine import make_engine

    a = RolloutActor(name, str(model), task, NoQueue(), settings, seed=0, env=env)
    a.engine = make_engine(str(model), settings.engine, 0, bool(settings.record_experts))
    try:
        a.episodes = make_runner(a.engine, task, settings, env, lambda: a.version)
        await a.engine.label(0)
        yield a
    finally:
        if a.engine is not None:  # None: shut down already (conftest's early release)
            a.engine.shutdown()
        a.engine = None


def plain_optim(**values):
    """conf/'s ``learner.optim`` with a constant LR and no off-policy brake (the plain
    AdamW step whose maths the learner tests check), ``values`` on top."""
    from asyncrl.learner.config import OptimSettings

    return OptimSettings.defaults(**{"schedule": "constant", "mismatch_kl_target": None, **values})


def fp32_learner(model, routing_replay: bool = False):
    """A one-rank learner on ``model`` (fp32, lr 1e-2) whose log-probs the vLLM tests
    compare with the engine's behaviour log-probs (``routing_replay``: a MoE model's
    ``learner.moe.routing_replay``)."""
    import torch

    from asyncrl.learner.config import LearnerSettings
    from asyncrl.learner.learner import Learner
    from asyncrl.losses.advantages import GroupNormalized
    from asyncrl.losses.clipped import ClippedISLoss

    torch.set_num_threads(1)
    moe = {"routing_replay": routing_replay}
    settings = LearnerSettings.defaults(optim=plain_optim(lr=1e-2), moe=moe)
    return Learner(str(model), ClippedISLoss(), GroupNormalized(), settings, temperature=1.0)


def replayed(learner) -> tuple[int, int]:
    """(positions with a record, of them routed to another set of experts than recorded)
    in the learner's last forward, over every MoE layer (asyncrl/learner/routing.py)."""
    n = differ = 0
    for f in learner.routing.forwards:
        rec, chosen = f.last
        have = (rec >= 0).all(-1)
        n += int(have.sum())
        same = rec[have].sort(-1).values == chosen[have].sort(-1).values
        differ += int((~same).any(-1).sum())
    return n, differ


def perturbed_state(learner, seed: int) -> dict:
    """Learner weights nudged by seeded noise (in place), as a state dict without the tied
    ``lm_head.weight``: a new policy version for the in-place update tests."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in learner.model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    sd = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
    sd.pop("lm_head.weight", None)
    return sd


CONF = Path(__file__).parents[1] / "conf"


def composed(*overrides: str):
    """The run's config as the CLI composes it from conf/ with ``overrides``."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("config", overrides=list(overrides))


def refused_before_ray(cfg, tmp_path, capsys, monkeypatch) -> str:
    """The one line ``asyncrl.train.execute`` prints when it refuses ``cfg``: exit 2, one
    ``asyncrl: config error:`` line, Ray never started, nothing written."""
    import asyncrl.train

    def no_ray(*_a, **_k):
        raise AssertionError("Ray was started before the config was refused")

    monkeypatch.setattr(asyncrl.train, "init_ray", no_ray)
    code = asyncrl.train.execute(cfg, tmp_path / "out")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("asyncrl: config error: "), err
    assert not (tmp_path / "out").exists()  # and before anything was written
    return err[0]


ROOT = Path(__file__).parents[1]
# the length and evaluation settings of the suite's shared short run (conftest.short_cli_run)
SHORT_RUN_STEPS, SHORT_RUN_EVAL = 8, ("eval.every=4", "eval.k=3", "eval.num_prompts=16")
# the shared short run steers its staleness bound (tests/test_steer_run.py)
SHORT_RUN_AUTO_BOUND = ("replay.max_staleness=auto", "replay.auto_widen_after=2")
# the shared short run is scored by the task's reward, the tiny reward model and the tiny
# judge at once (tests/test_reward_model_run.py); held-out evaluation scores the task's
SHORT_RUN_REWARD = (
    "reward=judge",
    "reward.components=[{_target_: asyncrl.rewards.task.TaskReward, weight: 1.0}, "
    "{_target_: asyncrl.rewards.rm.RewardModel, weight: 0.5, model: tiny}, "
    "{_target_: asyncrl.rewards.judge.Judge, weight: 0.25, model: tiny, retries: 0, timeout_s: 600}]",
)
# the default job with the strict answer verifier scored at weight 0 (every hacking rule
# live, the training reward the task's alone): conftest.default_run
DEFAULT_RUN_STEPS = 120
WITH_STRICT_AT_0 = (
    "reward.components=[{_target_: asyncrl.rewards.task.TaskReward, weight: 1.0}, "
    "{_target_: asyncrl.rewards.shaping.StrictAnswer, weight: 0.0}]"
)
MOE_WARM_START_STEPS = (
    20  # tiny_moe's preset takes 250 (minutes on 2 cores); 20 make a model to compare
)


def run_cli(
    out: Path, *overrides: str, timeout: int = 900, env=None
) -> subprocess.CompletedProcess:
    """``python -m asyncrl.train`` from the repository root into ``out`` (no progress bar)."""
    return subprocess.run(
        [sys.executable, "-m", "asyncrl.train", f"hydra.run.dir={out}", "progress=false",
         *overrides],
        cwd=ROOT, env={**(env or os.environ), "PYTHONUNBUFFERED": "1"}, capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip


USER_LOSS = textwrap.dedent("""
    import torch

    from asyncrl.losses import LossOutput, masked_mean, weighted_sum
    from asyncrl.losses.diagnostics import is_diagnostics


    class ScaledPG:
        needs_proximal = False
        needs_values = False

        def __init__(self, alpha: float = 1.0):
            self.alpha = alpha

        def __call__(self, batch, outputs):
            pg = -self.alpha * batch.advantages * outputs.logprobs
            metrics = is_diagnostics(batch, outputs)
            metrics["user/alpha_times_mask_mean"] = self.alpha * float(masked_mean(batch.mask.float(), batch.mask))
            return LossOutput(loss=weighted_sum(pg, batch), metrics=metrics)
""")


def write_user_loss(root: Path) -> Path:
    """A researcher's own package ``my_losses`` (``my_losses.scaled.ScaledPG``, outside
    asyncrl) under ``root``; returns the folder to put on PYTHONPATH."""
    pkg = root / "userlib" / "my_losses"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "scaled.py").write_text(USER_LOSS)
    return root / "userlib"


def collect_at(ray, queue, version: int, want: int = 8, timeout_s: float = 600.0,
               poll_s: float = 0.5) -> list:  # fmt: skip
    """``want`` trajectories generated wholly at ``version`` from the queue actor
    ``queue`` (older ones are dropped); asserts within ``timeout_s``."""
    import time

    from asyncrl.replay.queue import resolve_groups

    got = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want:
        assert time.monotonic() < deadline, len(got)
        while len(got) < want and (items := ray.get(queue.get_batch.remote(1, version, 0.05))):
            for it, g in zip(items, resolve_groups(items)):
                keep = set(it.traj_ids)
                got += [
                    t for t in g.trajectories
                    if t.traj_id in keep and len(t.versions) and (t.versions == version).all()
                ]  # fmt: skip
        time.sleep(poll_s)
    return got


def perturb_mlp0(rank, seed: int, scale: float) -> None:
    """Move layer 0's MLP weights (the decoder's, and a vision tower's where there is one)
    by ``scale`` times Gaussian noise: run on a learner rank's Ray actor with
    ``rank.__ray_call__.remote(perturb_mlp0, seed, scale)``; the fidelity tests use it to
    move log-probs far beyond their tolerance before a sync."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in rank.learner.model.named_parameters():
            if "layers.0.mlp" in name:
                p.add_(scale * torch.randn(p.shape, generator=g))


@contextlib.contextmanager
def halted_actor(ray, model: str, task, sampling, engine):
    """One ``ControlledRolloutActor`` ("actor0") on ``model`` with its engine started
    and its loop halted, bound to a parking queue that grants no slot: what
    :func:`learner_world` attaches a learner and a broker to, once or module after
    module (a TP-2 engine start costs ~20-45 s). Killed afterwards."""
    import time

    from controlled_actor import ControlledRolloutActor

    from asyncrl.actor.settings import ActorSettings
    from asyncrl.replay.queue import remote_queue

    parking = remote_queue(max_staleness=0, batch_groups=0)
    settings = ActorSettings.defaults(max_inflight_groups=2, sampling=sampling, engine=engine)
    cls = ray.remote(ControlledRolloutActor).options(num_cpus=0, max_concurrency=1000)
    actor = cls.remote("actor0", model, task, parking, settings, 0)
    try:
        t0 = time.monotonic()
        ray.get(actor.start.remote())
        print(f"engine start {time.monotonic() - t0:.0f} s")
        ray.get(actor.halt.remote())
        yield actor
    finally:
        ray.kill(actor)
        ray.kill(parking)


@contextlib.contextmanager
def learner_world(ray, cfg, model: str, sampling, actor, timeout_s: float, join_timeout_s: float):
    """For a started, halted ``actor`` (:func:`halted_actor`): a fresh queue it
    generates into, a learner from ``cfg.learner``, and a full-mode, verifying weight
    broker between them, which primes version 0 (the learner's initial weights, whatever
    the engine held before) before the actor's loop resumes. Yields ``{"actor",
    "learner", "broker", "queue"}``; afterwards the actor is halted again and the rest
    stopped."""
    from asyncrl.broker.client import start_weight_broker
    from asyncrl.broker.settings import BrokerSettings
    from asyncrl.learner.config import LearnerSettings
    from asyncrl.learner.group import start_learner
    from asyncrl.losses.advantages import GroupNormalized
    from asyncrl.losses.clipped import ClippedISLoss
    from asyncrl.replay.queue import remote_queue

    queue = remote_queue(max_staleness=1000, batch_groups=1, policy="drop", capacity_groups=4)
    loss = ClippedISLoss()
    learner = start_learner(
        LearnerSettings.from_config(cfg.learner, loss, 10), model, loss, GroupNormalized(),
        sampling, 0, 10, None,
    )  # fmt: skip
    try:
        learner.ping()
        ray.get(actor.rebind.remote(queue, 0))
        broker = start_weight_broker(
            BrokerSettings.defaults(mode="full", timeout_s=timeout_s,
                                    join_timeout_s=join_timeout_s, verify=True),
            {"actor0": actor}, learner.ranks,
        )  # fmt: skip
        try:
            ray.get(actor.resume.remote())
            yield {"actor": actor, "learner": learner, "broker": broker, "queue": queue}
        finally:
            try:
                broker.close()
            finally:
                ray.get(actor.halt.remote())
    finally:
        learner.close()
        ray.kill(queue)


@contextlib.contextmanager
def sync_world(
    ray, cfg, model: str, task, sampling, engine, timeout_s: float, join_timeout_s: float
):
    """:func:`halted_actor` and :func:`learner_world` together, for one module: what
    the fidelity tests (SmolLM2, VLM, LoRA) sync through. Yields ``{"actor",
    "learner", "broker", "queue"}``; all of it is stopped afterwards."""
    with (
        halted_actor(ray, model, task, sampling, engine) as actor,
        learner_world(ray, cfg, model, sampling, actor, timeout_s, join_timeout_s) as world,
    ):
        yield world


def plan_shard_digests(model_dir, full: dict, tp: int) -> list[dict[str, str]]:
    """Per engine TP rank, the digests of the full-tensor resharding plan's slice of
    ``full`` (the learner's whole state dict) for a model directory at TP size ``tp``."""
    import json

    from asyncrl.transport.endpoint import digests
    from asyncrl.transport.reshard import plan_for

    config = json.loads((Path(model_dir) / "config.json").read_text())
    plan = plan_for(config, [(k, tuple(v.shape)) for k, v in full.items()], tp)
    return [digests(plan.shard(r, full)) for r in range(tp)]


def publish_tp_sync(ray, w, version: int, mode: str, perturb, tp: int, model_dir):
    """Perturb every learner rank (``perturb(rank, version, mode)`` on each), publish
    ``version`` through the broker and wait: no broker error, every engine worker loaded
    ``version`` and exactly the full-tensor plan's slice for its TP rank. Returns the
    sync's metrics, the workers' loaded digests and each learner rank's shard digests."""
    learner, broker = w["learner"], w["broker"]
    ray.get([r.__ray_call__.remote(perturb, version, mode) for r in learner.ranks])
    broker.publish(version)
    m = broker.wait()
    assert m["broker/errors"] == 0, broker.errors
    loaded = ray.get(w["actor"].loaded_digests.remote())
    by_rank = ray.get([r.shard_digests.remote(tp) for r in learner.ranks])
    full = learner.full_state_dict()
    assert [x["digests"] for x in loaded] == plan_shard_digests(model_dir, full, tp)
    assert all(x["version"] == version for x in loaded)
    return m, loaded, by_rank
