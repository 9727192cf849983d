"""actor.* settings: checked once, naming the key; the production actor's remote
surface; new_actor. (Python-built settings equal the CLI's: test_settings_defaults.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from asyncrl.actor.settings import ActorSettings, UpdateMode
from asyncrl.config import ConfigError
from asyncrl.engine.settings import EngineSettings, SamplingSettings

YAML = Path(__file__).parents[1] / "conf" / "actor" / "default.yaml"


def test_defaults_merge_nested_values_and_keep_the_others():
    s = ActorSettings.defaults(update_mode="abort", sampling={"n": 4})
    assert s.update_mode is UpdateMode.ABORT
    assert s.sampling == SamplingSettings.defaults(n=4) and s.sampling.max_tokens == 6
    assert s.engine == EngineSettings.defaults() and s.handoff_linger_s == 0.1


def test_a_partial_config_names_the_missing_key():
    """No default hides in the dataclass: a node must hold every key (conf/ does)."""
    with pytest.raises(ConfigError, match="actor.num_actors is missing"):
        ActorSettings.from_config({"update_mode": "abort"})


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"update_mode": "bogus"}, "actor.update_mode='bogus': expected one of"),
        ({"bogus": 1}, "actor: unknown key(s) ['bogus']"),
        ({"sampling": {"bogus": 1}}, "actor.sampling: unknown key(s) ['bogus']"),
        ({"engine": {"bogus": 1}}, "actor.engine: unknown key(s) ['bogus']"),
        ({"num_actors": 0}, "actor.num_actors=0: expected an integer >= 1"),
        ({"num_cpus": -1}, "actor.num_cpus=-1.0: expected a number >= 0"),
        ({"max_inflight_groups": 0}, "actor.max_inflight_groups=0"),
        ({"max_inflight_groups": 2.5}, "actor.max_inflight_groups=2.5"),
        ({"handoff_linger_ms": -1}, "actor.handoff_linger_ms=-1"),
        ({"engine_cores": "3-1"}, "actor.engine_cores='3-1': not a CPU list"),
        ({"engine_cores": []}, "actor.engine_cores=[]: not a CPU list"),
        ({"sampling": {"n": 0}}, "actor.sampling.n=0"),
        (
            {"sampling": {"temperature": 0.0}},
            "actor.sampling.temperature=0.0: expected a number > 0",
        ),
        ({"sampling": {"top_p": 1.5}}, "actor.sampling.top_p=1.5"),
        ({"sampling": {"top_k": -2}}, "actor.sampling.top_k=-2"),
        ({"sampling": {"max_tokens": True}}, "actor.sampling.max_tokens=True"),
        ({"engine": {"dtype": "fp8"}}, "actor.engine.dtype='fp8': expected one of"),
        ({"engine": {"max_model_len": 0}}, "actor.engine.max_model_len=0"),
        ({"engine": {"enforce_eager": "yes"}}, "actor.engine.enforce_eager='yes'"),
        ({"engine": {"gpu_memory_utilization": 0}}, "actor.engine.gpu_memory_utilization=0"),
        ({"engine": {"extra": [1]}}, "actor.engine.extra=[1]"),
    ],
)
def test_every_bad_value_is_refused_naming_its_key(override, message):
    cfg = OmegaConf.to_container(OmegaConf.load(YAML))
    for key, value in override.items():
        if isinstance(value, dict):
            cfg[key].update(value)
        else:
            cfg[key] = value
    with pytest.raises(ConfigError) as e:
        ActorSettings.from_config(cfg)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_cpu_lists_arrive_as_one_string():
    """`actor.engine_cores=0` arrives as an int, a YAML list as a list: one string each."""
    for given, want in ((0, "0"), ("0-1", "0-1"), ([0, "2-3"], "0,2-3"), (None, None)):
        assert ActorSettings.defaults(engine_cores=given).engine_cores == want


def test_the_production_actor_has_only_the_production_remote_methods():
    """Test and benchmark controls (halt, rebind, fault injection, ...) live on
    ControlledRolloutActor, not on the actor training starts."""
    from controlled_actor import ControlledRolloutActor

    from asyncrl.actor.rollout import RolloutActor

    def remote_methods(cls):
        return {n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n))}

    assert remote_methods(RolloutActor) == {
        "start", "stop", "get_stats", "ping", "sampler_state", "load_sampler_state",
        "update_weights", "receive_weights", "weight_state", "close_weight_groups", "set_rewards",
        "pids",  # the engine processes it started: the supervisor kills their orphans
        "take_bundle",  # the queue takes each hand-off's bundle: it then owns the object
    }  # fmt: skip
    assert remote_methods(ControlledRolloutActor) - remote_methods(RolloutActor) == {
        "halt", "rebind", "resume", "set_update_mode", "inject_weight_fault",
        "loaded_digests", "checksums", "worker_params",
        "introduce",  # start()'s first hand-off, for an actor a test gives its engine
        "episodes_with",  # another env's episodes on this engine (the VLM fidelity test)
    }  # fmt: skip


def test_set_update_mode_names_the_modes():
    from controlled_actor import ControlledRolloutActor

    from asyncrl.tasks.arithmetic import AdditionTask

    a = ControlledRolloutActor("t", "m", AdditionTask(), None, ActorSettings.defaults())
    a.set_update_mode("wait")
    assert a.update_mode is UpdateMode.WAIT
    with pytest.raises(ConfigError, match="expected one of abort, wait, keep"):
        a.set_update_mode("later")


def test_new_actor_starts_the_given_class_as_a_ray_actor(ray_local):
    """Not started (no engine): the actor answers, with its settings and seed."""
    from controlled_actor import ControlledRolloutActor

    from asyncrl.actor.launch import new_actor
    from asyncrl.tasks.arithmetic import AdditionTask

    ray = ray_local
    settings = ActorSettings.defaults(num_cpus=0, sampling=SamplingSettings.defaults(n=2))
    a = new_actor(settings, "/no/model", AdditionTask(), None, "actor7", 3, ControlledRolloutActor)
    try:
        assert ray.get(a.ping.remote()) == "actor7"
        assert ray.get(a.sampler_state.remote())["seed"] == 3
        ray.get(a.set_update_mode.remote("abort"))  # the controls are there
    finally:
        ray.kill(a)
