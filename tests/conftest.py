"""Shared fixtures: the tiny model (built once, cached), a local Ray on loopback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def task():
    from asyncrl.tasks.arithmetic import AdditionTask

    return AdditionTask(max_operand=19)


@pytest.fixture(scope="session")
def tiny_model(task) -> Path:
    """The default run's tiny model (same spec as conf/model/tiny.yaml, so the cache is shared)."""
    from asyncrl.models.tiny import default_spec, ensure_tiny_model

    return ensure_tiny_model(task, default_spec())


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the session, on loopback; only what we started is stopped."""
    import ray

    if not ray.is_initialized():
        ray.init(
            _node_ip_address="127.0.0.2",
            num_cpus=4,
            include_dashboard=False,
            runtime_env={
                "env_vars": {"VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
            },
        )
    yield ray
    ray.shutdown()
