"""Periodic held-out evaluation (asyncrl/eval): its settings refused at start-up, an
honest held-out split, the driver skipping versions instead of waiting, and one short
real run with evaluation on (slow)."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
from helpers import SHORT_RUN_EVAL, SHORT_RUN_STEPS
from hydra import compose, initialize_config_dir

from asyncrl.eval.driver import Evaluator
from asyncrl.eval.settings import EvalSettings
from asyncrl.eval.split import TrainSplit, heldout_prompts, is_heldout
from asyncrl.tasks.arithmetic import AdditionTask
from asyncrl.tasks.base import Prompt

CONF = Path(__file__).parents[1] / "conf"


def cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("config", overrides=list(overrides))


BAD = [
    ("eval.every=-1", "eval.every=-1"),
    ("eval.k=0", "eval.k=0"),
    ("eval.max_inflight_groups=0", "eval.max_inflight_groups=0"),
    ("eval.num_prompts=abc", "eval.num_prompts='abc': expected an integer"),
    ("eval.heldout_frac=1.5", "eval.heldout_frac=1.5"),
    ("+eval.bogus=1", "eval: unknown key(s) ['bogus']"),
    ("+eval.sets.hard.bogus=1", "eval.sets.hard: unknown key(s) ['bogus']"),
    ("+eval.sets.big.task._target_=no.such.Task", "eval.sets.big.task"),
]


@pytest.mark.parametrize("override,names", BAD, ids=[o for o, _ in BAD])
def test_a_bad_eval_value_stops_the_run_before_ray(override, names, tmp_path, capsys, monkeypatch):
    import asyncrl.train
    from asyncrl.train import execute

    def no_ray(*_a, **_k):
        raise AssertionError("Ray was started before the config was refused")

    monkeypatch.setattr(asyncrl.train, "init_ray", no_ray)
    # eval.every=5: the sets are built (and their task configs checked) only when on
    code = execute(cfg("eval.every=5", override, "progress=false"), tmp_path / "out")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("asyncrl: config error: "), err
    assert names in err[0], err[0]


def test_the_default_config_has_evaluation_off_and_valid():
    s = EvalSettings.from_config(cfg().eval)
    assert not s.enabled and s.k == 4 and list(s.sets) == ["heldout"]


def test_the_held_out_problems_never_reach_training():
    """The default task has 400 problems; the training stream with evaluation on draws
    none of the held-out ones, and together they cover the whole space."""
    task = AdditionTask(max_operand=19)
    train = TrainSplit(task, 0.1)
    rng = random.Random(0)
    seen = {train.sample(rng).text for _ in range(20000)}
    held = {p.text for p in heldout_prompts(task, 0.1, seed=1, n=100)}
    assert not seen & held
    assert len(seen | held) == 400 and 20 <= len(held) <= 60, (len(seen), len(held))
    assert all(is_heldout(t, 0.1) for t in held)
    # a set of num_prompts: distinct, and the same for the same seed
    a = [p.text for p in heldout_prompts(task, 0.1, seed=3, n=16)]
    assert len(set(a)) == 16 and a == [p.text for p in heldout_prompts(task, 0.1, seed=3, n=16)]
    # the wrapper still is the task for everything else (the tiny model's alphabet)
    assert train.alphabet == task.alphabet and train.reward(*_scored(task)) == task.reward(
        *_scored(task)
    )


def test_image_prompts_are_split_by_the_problem_in_the_image():
    """task=visual_addition's prompts all read ``<image>``: the split goes by the sum
    drawn (``meta["shown"]``): training draws exactly the problems whose key is not held
    out, and a held-out set holds distinct held-out problems (operands up to 9: a
    100-problem space, each prompt a rendered PNG)."""
    from asyncrl.eval.split import problem_key
    from asyncrl.tasks.visual import VisualAdditionTask

    task = VisualAdditionTask(max_operand=9)
    shown = {f"{a}+{b}=" for a in range(10) for b in range(10)}
    held_out = {t for t in shown if is_heldout(f"<image>\0{t}", 0.1)}
    assert 3 <= len(held_out) <= 20, held_out
    train = TrainSplit(task, 0.1)
    rng = random.Random(0)
    seen = {train.sample(rng).meta["shown"] for _ in range(1000)}
    assert seen == shown - held_out
    held = [p.meta["shown"] for p in heldout_prompts(task, 0.1, seed=1, n=3)]
    assert len(set(held)) == 3 and set(held) <= held_out, held
    p = task.sample(random.Random(2))
    assert problem_key(p) == f"<image>\0{p.meta['shown']}"  # not the drawing
    unnamed = Prompt(text="<image>", answer="", meta={"images": [b"a"]})
    assert problem_key(unnamed) != problem_key(Prompt("<image>", "", meta={"images": [b"b"]}))


def _scored(task):
    p = task.sample(random.Random(5))
    return p, p.answer


class _GatedEval:
    """Stands in for EvalActor across the Ray boundary: an evaluation runs until the
    test opens the gate, with fixed pass rates by version."""

    def __init__(self):
        import asyncio

        self.gate = asyncio.Event()

    async def evaluate(self, ref_list, version):
        await self.gate.wait()
        self.gate.clear()
        p = {2: 0.25, 6: 0.5}[version]
        return {"version": version, "seconds": 0.0,
                "sets": {"heldout": {"pass@1": p, "pass@k": p + 0.25, "reward_mean": p}}}  # fmt: skip

    async def release(self):
        self.gate.set()


class _Rank:
    def weights_ref(self):
        return {"refs": [None], "bytes": 0}


def test_a_busy_evaluator_skips_versions_and_training_does_not_wait(ray_local):
    import sys

    from ray import cloudpickle

    ray = ray_local
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the fakes travel by value
    actor = ray.remote(_GatedEval).options(num_cpus=0).remote()
    rank = ray.remote(_Rank).options(num_cpus=0).remote()
    ray.get(rank.weights_ref.remote())  # both up before the clock matters
    ev = Evaluator(EvalSettings.defaults(every=2), actor, [rank])
    logged, slowest = {}, 0.0

    def step(v):
        nonlocal slowest
        t = time.time()
        logged[v] = ev.step(v)
        slowest = max(slowest, time.time() - t)

    for v in (1, 2, 3, 4):  # 2 starts and hangs: 4 is skipped, nobody waits
        step(v)
    ray.get(actor.release.remote())
    ray.wait([ev.pending], timeout=60)
    for v in (5, 6, 7, 8):  # 5 collects version 2's result; 6 starts; 8 is skipped
        step(v)
    ray.get(actor.release.remote())
    logged["end"] = ev.finish()
    assert slowest < 5.0, slowest  # a step costs a weights_ref call, never an evaluation
    assert ev.skipped == [4, 8], ev.skipped
    assert logged[4]["eval/skipped_versions"] == 1.0 and logged[8]["eval/skipped_versions"] == 2.0
    got = {k: m for k, m in logged.items() if "eval/heldout/version" in m}
    assert {k: m["eval/heldout/version"] for k, m in got.items()} == {5: 2.0, "end": 6.0}
    assert got[5]["eval/heldout/pass@1"] == 0.25 and got["end"]["eval/heldout/pass@k"] == 0.75
    assert ev.summary() == {
        "heldout": {"first": 0.25, "last": 0.5, "best": 0.5, "version_best": 6,
                    "version_first": 2, "version_last": 6, "pass@k_first": 0.5,
                    "pass@k_last": 0.75, "pass@k_best": 0.75, "evaluations": 2}
    }  # fmt: skip
    for a in (actor, rank):
        ray.kill(a)


@pytest.mark.slow
def test_a_short_run_with_evaluation_on(short_cli_run):
    """The real thing: the shared short CLI run (tests/conftest.py: eval.every=4, eval.k=3,
    eval.num_prompts=16 for 8 steps); eval/* in TensorBoard and summary.json, pass rates
    are rates, the versions evaluated are the ones asked for."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert SHORT_RUN_STEPS == 8 and SHORT_RUN_EVAL[0] == "eval.every=4"
    out = short_cli_run
    s = json.loads((out / "summary.json").read_text())
    e = s["eval"]["heldout"]
    assert (
        e["version_first"] == 4 and e["version_last"] in (4, 8) and s["eval_skipped_versions"] == []
    )
    assert 0 <= e["first"] <= 1 and 0 <= e["best"] <= 1 and e["version_best"] in (4, 8)
    assert e["best"] == max(e["first"], e["last"])
    assert 0 <= e["pass@k_first"] <= 1 and 0 <= e["pass@k_last"] <= 1
    ea = EventAccumulator(str(out / "tb"))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert {"eval/heldout/pass@1", "eval/heldout/pass@k", "eval/heldout/version",
            "eval/skipped_versions"} <= tags  # fmt: skip
    versions = [int(x.value) for x in ea.Scalars("eval/heldout/version")]
    assert versions[0] == 4 and versions == sorted(versions)
