"""Shared fixtures: the tiny model (built once, cached), a local Ray on loopback, and the
real CLI runs that several test files read."""

from __future__ import annotations

import contextlib
import functools
import os
import re
from pathlib import Path

import pytest
import pytest_asyncio
from helpers import (
    DEFAULT_RUN_STEPS,
    MOE_WARM_START_STEPS,
    SHORT_RUN_AUTO_BOUND,
    SHORT_RUN_EVAL,
    SHORT_RUN_REWARD,
    SHORT_RUN_STEPS,
    WITH_STRICT_AT_0,
    composed,
    engine_actor,
    halted_actor,
    run_cli,
    write_user_loss,
)

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


# Session fixtures worth building once per worker: the test files that name one run on
# the same pytest-xdist worker, so the fixture is built once there (``tool_run``: the
# 12-step run that tests/test_inspect.py makes once per worker's basetemp).
SHARED_FIXTURES = (
    "vllm_actor", "short_cli_run", "default_run", "moe_model", "tool_run", "tp_actor",
    "tp_moe_actor",
)  # fmt: skip
# Session engines shut down after their last test rather than at the end of the session:
# the files after it get their memory and cores back.
ENGINE_FIXTURES = ("vllm_actor", "tp_actor", "tp_moe_actor")
TESTS = Path(__file__).parent


@functools.cache
def group_of(file: str) -> str:
    """A test file's unit of work under pytest-xdist: the first shared session fixture
    its source names, else the file itself."""
    path = TESTS / Path(file).name
    text = path.read_text() if path.is_file() else ""
    return next((f for f in SHARED_FIXTURES if re.search(rf"\b{f}\b", text)), file)


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``: whole files to a worker, with the files that share a session
    fixture together (:func:`group_of`), in the order the workers collected them."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LoadGroupOfFiles(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid.split("::", 1)[0])

    return LoadGroupOfFiles(config, log)


def order_for_workers(items) -> None:
    """Under pytest-xdist: the groups ordered longest first by the last full run's
    seconds (tests/durations.json), so that the long ones start at once and the short
    ones fill the gaps at the end. A serial run keeps pytest's own order."""
    from durations import load

    seconds = load()
    files: dict[str, set[str]] = {}
    first: dict[str, int] = {}
    for n, i in enumerate(items):
        files.setdefault(group_of(i.path.name), set()).add(i.path.name)
        first.setdefault(group_of(i.path.name), n)
    # summed in one order and rounded: every worker must sort alike (a set's order, and
    # so a float sum's last bit, differs between processes)
    cost = {g: round(sum(seconds.get(f, 0.0) for f in sorted(fs)), 3) for g, fs in files.items()}
    items.sort(key=lambda i: (-cost[group_of(i.path.name)], first[group_of(i.path.name)]))


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):
        order_for_workers(items)
    last = {}
    for name in ENGINE_FIXTURES:
        users = [i for i in items if uses_engine(i, name)]
        if users:
            last[name] = users[-1]
    config.stash[LAST_ENGINE_USERS] = last
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionstart(session):
    """The controller (a serial run's one process) notes what /dev/shm holds
    (tests/shm_leftovers.py)."""
    if not hasattr(session.config, "workerinput"):
        from shm_leftovers import entries

        session.config.stash[SHM_BEFORE] = entries()


def pytest_sessionfinish(session):
    """The controller removes the shared memory that the session's killed processes left
    (after the workers ended)."""
    before = session.config.stash.get(SHM_BEFORE, None)
    if before is not None:
        from shm_leftovers import remove_leftovers

        remove_leftovers(before)


SHM_BEFORE = pytest.StashKey[set]()  # /dev/shm's entries when the session began
LAST_ENGINE_USERS = pytest.StashKey[dict]()  # fixture name -> its last test
ENGINE_CLOSERS = pytest.StashKey[dict]()  # fixture name -> what shuts its engine down


def uses_engine(item, name: str) -> bool:
    return uses_vllm_actor(item) if name == "vllm_actor" else name in item.fixturenames


def last_engine_user(config, name: str):
    """The last test of this session that uses session engine ``name``, or None."""
    return config.stash.get(LAST_ENGINE_USERS, {}).get(name)


@contextlib.contextmanager
def closed_after_last_user(config, name: str, closer):
    """While in it, ``closer`` runs after the teardown of ``name``'s last test (the
    module fixtures built on it are gone by then); not after the fixture's own end."""
    closers = config.stash.setdefault(ENGINE_CLOSERS, {})
    closers[name] = closer
    try:
        yield
    finally:
        closers.pop(name, None)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """A session engine (``ENGINE_FIXTURES``) shut down after its last test."""
    for name, last in item.config.stash.get(LAST_ENGINE_USERS, {}).items():
        if item is last and (closer := item.config.stash.get(ENGINE_CLOSERS, {}).pop(name, None)):
            closer()


@pytest.fixture(scope="session")
def task():
    from asyncrl.tasks.arithmetic import AdditionTask

    return AdditionTask(max_operand=19)


@pytest.fixture(scope="session")
def tiny_model(task) -> Path:
    """The default run's tiny model (same spec as conf/model/tiny.yaml, so the cache is shared)."""
    from asyncrl.models.tiny import default_spec, ensure_tiny_model

    return ensure_tiny_model(task, default_spec())


# SmolLM2's chat template (ChatML), for tests of the chat form without a 135M model
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture
def chat_model(tiny_model, tmp_path):
    """The tiny model's files with a ChatML template (:data:`CHATML`) added."""
    import shutil

    out = tmp_path / "chat"
    shutil.copytree(tiny_model, out)
    (out / "chat_template.jinja").write_text(CHATML)
    return out


@pytest.fixture(scope="session")
def moe_model(tmp_path_factory, task) -> Path:
    """``model=tiny_moe`` with a short warm start (``MOE_WARM_START_STEPS``), built once
    per worker in a fresh cache."""
    from asyncrl.models.resolve import resolve_model

    cache = tmp_path_factory.mktemp("moe_cache")
    cfg = composed("model=tiny_moe", f"model.tiny.warm_start_steps={MOE_WARM_START_STEPS}",
                   f"model.cache_dir={cache}")  # fmt: skip
    return resolve_model(cfg, task)


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

        def shut_down() -> None:
            if a.engine is not None:
                a.engine.shutdown()
                a.engine = None

        with closed_after_last_user(request.config, "vllm_actor", shut_down):
            yield a


TP2_SAMPLING = {"n": 4, "temperature": 1.0, "max_tokens": 8}


@contextlib.contextmanager
def tp2_actor(ray, model, task, request, name: str):
    """A halted actor whose vLLM-CPU engine runs two workers (tensor_parallel_size=2)
    with tests/shard_probe.py's extension, and the sampling it was built with; killed
    after the last test that uses fixture ``name``."""
    from asyncrl.engine.settings import EngineSettings, SamplingSettings

    sampling = SamplingSettings.defaults(**TP2_SAMPLING)
    engine = EngineSettings.defaults(
        tensor_parallel_size=2, max_num_seqs=16, kv_cache_memory_mb=64,
        extra={"worker_extension_cls": "tests.shard_probe.ShardProbeExtension"},
    )  # fmt: skip
    with (
        halted_actor(ray, str(model), task, sampling, engine) as actor,
        closed_after_last_user(request.config, name, lambda: ray.kill(actor)),
    ):
        yield {"actor": actor, "sampling": sampling}


@pytest.fixture(scope="session")
def tp_actor(ray_local, tiny_model, task, request):
    """The tiny model on a TP-2 engine (:func:`tp2_actor`), shared by the files that each
    attach their own learner and broker to it (helpers.learner_world, which primes the
    learner's initial weights): tests/test_tp_engine.py (a one-rank learner, resharded
    by the broker), tests/test_tp_broker.py (a TP-2 learner sending its shards)."""
    with tp2_actor(ray_local, tiny_model, task, request, "tp_actor") as shared:
        yield shared


@pytest.fixture(scope="session")
def tp_moe_actor(ray_local, moe_model, task, request):
    """``model=tiny_moe`` on a TP-2 engine (:func:`tp2_actor`), shared the same way by
    tests/test_tp_moe_engine.py and tests/test_tp_moe_broker.py."""
    with tp2_actor(ray_local, moe_model, task, request, "tp_moe_actor") as shared:
        yield shared


@pytest.fixture(scope="session")
def short_cli_run(tmp_path_factory, tiny_model) -> Path:
    """One short real ``python -m asyncrl.train`` (an engine start and SHORT_RUN_STEPS
    steps) shared by the tests that each check one feature through the CLI: evaluation
    on (tests/test_eval.py), a researcher's loss class from their own module, found
    through PYTHONPATH, with ``+loss.alpha=0.3`` (tests/test_user_loss.py), a
    staleness bound that steers itself (tests/test_steer_run.py), and a reward of the
    task's, the tiny reward model's and the tiny judge's (tests/test_reward_model_run.py)."""
    base = tmp_path_factory.mktemp("short_cli_run")
    userlib = write_user_loss(base)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(userlib), os.environ.get("PYTHONPATH", "")])
    )
    out = base / "run"
    r = run_cli(out, f"max_steps={SHORT_RUN_STEPS}", *SHORT_RUN_EVAL, *SHORT_RUN_AUTO_BOUND,
                *SHORT_RUN_REWARD, "loss._target_=my_losses.scaled.ScaledPG", "+loss.alpha=0.3",
                env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    return out


@pytest.fixture(scope="session")
def default_run(tmp_path_factory, tiny_model) -> Path:
    """The default job through ``python -m asyncrl.train`` for DEFAULT_RUN_STEPS steps,
    with the strict answer verifier scored at weight 0 beside the task's reward (the
    same training reward; every hacking rule live): what the README promises of the
    default run (tests/test_e2e.py) and an honest run the hacking monitors leave quiet
    (tests/test_hacking_run.py)."""
    out = tmp_path_factory.mktemp("default_run") / "run"
    r = run_cli(out, f"max_steps={DEFAULT_RUN_STEPS}", WITH_STRICT_AT_0)
    assert r.returncode == 0, r.stderr[-4000:]
    return out
