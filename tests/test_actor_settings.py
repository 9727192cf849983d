"""actor.* settings: checked once, naming the key; the defaults in code are the
shipped YAML's; the production actor's remote surface; new_actor."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from asyncrl.actor.settings import ActorSettings, EngineSettings, SamplingSettings, UpdateMode
from asyncrl.config import ConfigError

YAML = Path(__file__).parents[1] / "conf" / "actor" / "default.yaml"


def test_the_defaults_in_code_are_the_shipped_yaml():
    """One source of truth: an ActorSettings built in code and one built from
    conf/actor/default.yaml are the same, key by key (and the YAML has no key the
    settings do not know)."""
    from_yaml = ActorSettings.from_config(OmegaConf.load(YAML))
    assert asdict(from_yaml) == asdict(ActorSettings())
    assert from_yaml.sampling.max_tokens == 6


def test_a_partial_config_keeps_the_other_defaults():
    s = ActorSettings.from_config({"update_mode": "abort", "sampling": {"n": 4}})
    assert s.update_mode is UpdateMode.ABORT and s.sampling == SamplingSettings(n=4)
    assert s.engine == EngineSettings() and s.handoff_linger_s == 0.1


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"update_mode": "bogus"}, "actor.update_mode='bogus': expected one of abort, wait, keep"),
        ({"bogus": 1}, "actor.bogus: unknown key; actor accepts num_actors"),
        ({"sampling": {"bogus": 1}}, "actor.sampling.bogus: unknown key"),
        ({"engine": {"bogus": 1}}, "actor.engine.bogus: unknown key"),
        ({"num_actors": 0}, "actor.num_actors=0: expected an integer >= 1"),
        ({"num_cpus": -1}, "actor.num_cpus=-1: expected a number >= 0"),
        ({"max_inflight_groups": 0}, "actor.max_inflight_groups=0"),
        ({"max_inflight_groups": 2.5}, "actor.max_inflight_groups=2.5"),
        ({"handoff_linger_ms": -1}, "actor.handoff_linger_ms=-1"),
        ({"engine_cores": "3-1"}, "actor.engine_cores='3-1': not a CPU list"),
        ({"engine_cores": []}, "actor.engine_cores=[]: not a CPU list"),
        ({"sampling": {"n": 0}}, "actor.sampling.n=0"),
        ({"sampling": {"temperature": 0.0}}, "actor.sampling.temperature=0.0: expected > 0"),
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
        assert ActorSettings.from_config({"engine_cores": given}).engine_cores == want


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
        "loaded_digests", "checksums",
    }  # fmt: skip


def test_set_update_mode_names_the_modes():
    from controlled_actor import ControlledRolloutActor

    from asyncrl.tasks.arithmetic import AdditionTask

    a = ControlledRolloutActor("t", "m", AdditionTask(), None, ActorSettings())
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
    settings = ActorSettings(num_cpus=0, sampling=SamplingSettings(n=2))
    a = new_actor(settings, "/no/model", AdditionTask(), None, "actor7", 3, ControlledRolloutActor)
    try:
        assert ray.get(a.ping.remote()) == "actor7"
        assert ray.get(a.sampler_state.remote())["seed"] == 3
        ray.get(a.set_update_mode.remote("abort"))  # the controls are there
    finally:
        ray.kill(a)
