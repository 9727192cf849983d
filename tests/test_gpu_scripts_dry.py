"""The GPU check scripts run their ``--dry-run-on-cpu`` mode (cpu/gloo in place of
cuda/nccl, the same code) so they cannot rot between the sessions lent a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


# The GPU machine has torch and transformers but neither Ray nor vLLM: the scripts run
# here with both imports made to fail, as they would there.
WITHOUT_RAY_OR_VLLM = """
import runpy, sys
sys.modules["ray"] = sys.modules["vllm"] = None
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_script(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_RAY_OR_VLLM, f"benchmarks/{script}", *args],
        cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def last_json(r: subprocess.CompletedProcess) -> dict:
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads([line for line in r.stdout.splitlines() if line.strip()][-1])


def test_gpu_check_dry_run_on_cpu():
    f = last_json(run_script("gpu_check.py", "--dry-run-on-cpu"))
    assert f["ok"] is True
    assert f["checks"]["two-rank NCCL sync across two GPUs"] == "SKIP"
    assert list(f["checks"].values()).count("PASS") == 5
    assert 0 < f["sparse_frac"] < 0.5 and f["cuda_delta_gbps"] > 0
    assert len(f["nccl_one_full_seconds"]) == 2


@pytest.mark.parametrize("size, minibatches", [("tiny", 2), ("0.5b", 1)])
def test_gpu_learner_check_dry_run_on_cpu(size, minibatches):
    args = ("--dry-run-on-cpu", "--size", size, "--minibatches", str(minibatches))
    f = last_json(run_script("gpu_learner_check.py", *args))
    assert f["passed"] is True and f["size"] == size and f["sharded"] is False
    assert f["minibatches"] == minibatches
    assert f["tokens_per_s"] > 0 and f["stream_to_cpu_gbps"] > 0 and f["first_step_s"] > 0


def test_gpu_learner_check_refuses_an_unknown_size():
    r = run_script("gpu_learner_check.py", "--dry-run-on-cpu", "--size", "7b")
    assert r.returncode != 0 and "--size must be one of" in r.stderr


# ------------------------------------------------- +experiment=gpu_cluster, on paper
GPU_CLUSTER_PROBE = r'''
import json, sys
import ray
from hydra import compose, initialize_config_dir
from asyncrl.actor.launch import new_actor
from asyncrl.actor.settings import ActorSettings
from asyncrl.confdir import conf_dir
from asyncrl.learner import rank as rank_module
from asyncrl.learner.config import LearnerSettings
from asyncrl.learner.group import LearnerGroup
from asyncrl.losses.clipped import ClippedISLoss


class Probe:
    """Stands in for a RolloutActor / a Learner rank (whose __init__ needs CUDA): it
    only reports the GPUs Ray gave its process."""

    def __init__(self, *args, **kwargs):
        pass

    def gpus(self):
        return [str(g) for g in ray.get_runtime_context().get_accelerator_ids()["GPU"]]


rank_module.LearnerRank = Probe  # LearnerGroup takes the rank class from there
with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
    cfg = compose("config", overrides=["+experiment=gpu_cluster"])
actor = ActorSettings.from_config(cfg.actor)
loss = ClippedISLoss()
learner = LearnerSettings.from_config(cfg.learner, loss, 10)
need = actor.num_actors * actor.num_gpus + learner.world_size * learner.num_gpus
# a GPU-less Ray told it has `need` GPUs: it schedules them as it would real ones
ray.init(num_cpus=64, num_gpus=int(need), include_dashboard=False,
         _node_ip_address="127.0.0.2", log_to_driver=False)
actors = [new_actor(actor, "m", None, None, f"actor{i}", i, cls=Probe)
          for i in range(actor.num_actors)]
group = LearnerGroup("m", loss, None, learner)
from ray.util.placement_group import placement_group_table
pg = placement_group_table(group.pg)
print(json.dumps({
    "need": need,
    "actor_num_gpus": actor.num_gpus,
    "learner_num_gpus": learner.num_gpus,
    "actor_gpus": ray.get([a.gpus.remote() for a in actors]),
    "rank_gpus": ray.get([r.gpus.remote() for r in group.ranks]),
    "strategy": pg["strategy"],
    "bundles": list(pg["bundles"].values()),
}))
ray.shutdown()
'''


def test_gpu_cluster_experiment_gives_every_actor_and_rank_its_own_gpu():
    """+experiment=gpu_cluster through the real launch code (new_actor's options, the
    learner's placement group), on a Ray told it has 8 GPUs: no two of the 4 actors
    and 4 learner ranks share one. Runs in its own process: its Ray is not the
    session's."""
    r = subprocess.run(
        [sys.executable, "-c", GPU_CLUSTER_PROBE], cwd=ROOT, capture_output=True, text=True,
        timeout=600, env={k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"},
    )  # fmt: skip
    f = last_json(r)
    assert f["actor_num_gpus"] == 1 and f["learner_num_gpus"] == 1 and f["need"] == 8
    assert all(len(g) == 1 for g in f["actor_gpus"] + f["rank_gpus"])
    every = [g[0] for g in f["actor_gpus"] + f["rank_gpus"]]
    assert len(set(every)) == 8, every  # 4 engines + 4 ranks, one GPU each, none shared
    assert f["strategy"] == "PACK"
    assert f["bundles"] == [{"CPU": 1.0, "GPU": 1.0}] * 4
