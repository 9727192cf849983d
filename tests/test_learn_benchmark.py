"""benchmarks/learn.py: its figures from an evaluator's history and a run's steps
(the real run, SmolLM2 for many minutes, is the benchmark itself)."""

import math

from benchmarks.common import compose
from benchmarks.learn import EVAL_TIMEOUT_S, TASKS, eval_overrides, summarise


def test_gain_against_the_spread_of_the_sets_before_training():
    history = {  # set -> (version, pass@1, pass@k): scored at 0 and at 30
        "s1": [(0, 0.25, 0.5), (30, 0.50, 0.75)],
        "s2": [(0, 0.30, 0.5), (30, 0.45, 0.70)],
        "s3": [(0, 0.20, 0.4), (30, 0.55, 0.80)],
    }
    steps = [{"reward/sum": float(i), "reward/count": 10.0} for i in range(20)]
    q = {"produced": 100, "trained": 80, "dropped_stale": 4, "in_flight": 16}
    r = summarise("chain_sum", history, steps, q, 12.0, 30.0)
    assert math.isclose(r["mean_before"], 0.25) and math.isclose(r["mean_after"], 0.50)
    assert math.isclose(r["spread_before"], 0.10)  # 0.30 - 0.20
    assert math.isclose(r["gain"], 0.25) and r["learned"] is True
    assert r["version_after"] == 30 and r["accounted"] is True
    assert math.isclose(r["reward_first"], 0.05)  # steps 0 and 1: (0 + 1) / 20
    assert math.isclose(r["reward_last"], 1.85)  # steps 18 and 19: (18 + 19) / 20


def test_a_gain_within_the_spread_is_not_learning():
    history = {"s1": [(0, 0.2, 0.4), (8, 0.3, 0.4)], "s2": [(0, 0.4, 0.6), (8, 0.35, 0.6)]}
    q = {"produced": 10, "trained": 8, "dropped_stale": 0, "in_flight": 1}
    r = summarise("addition", history, [{"reward/sum": 1.0, "reward/count": 2.0}], q, 1.0, 2.0)
    assert math.isclose(r["gain"], 0.025) and math.isclose(r["spread_before"], 0.2)
    assert r["learned"] is False and r["accounted"] is False  # 8 + 0 + 1 != 10


def test_every_task_composes_with_three_held_out_sets():
    for name in TASKS:
        cfg = compose("model=smollm2", *TASKS[name], *eval_overrides(30, 64, 4))
        assert sorted(cfg.eval.sets) == ["s1", "s2", "s3"]
        assert [cfg.eval.sets[s].seed for s in sorted(cfg.eval.sets)] == [1, 2, 3]
        assert cfg.eval.every == 30 and cfg.eval.num_prompts == 64
        assert cfg.eval.timeout_s == EVAL_TIMEOUT_S


def test_the_tasks_own_score_before_and_after_per_set():
    from benchmarks.learn import scores

    first = {"eval/s1/reward_mean": 0.02, "eval/s2/reward_mean": 0.04, "eval/s1/pass@1": 0.0}
    last = {"eval/s1/reward_mean": 0.20, "eval/s2/reward_mean": 0.10, "eval/seconds": 3.0}
    r = scores(first, last)
    assert r["score_before"] == [0.02, 0.04] and r["score_after"] == [0.20, 0.10]
    assert math.isclose(r["score_spread_before"], 0.02)
    assert math.isclose(r["score_gain"], 0.12) and r["score_learned"] is True  # 0.15 - 0.03


def test_the_commonest_answer_is_the_floor_of_a_yes_no_task():
    from asyncrl.tasks.base import Prompt
    from benchmarks.learn import majority

    yes, no = Prompt("q", "Yes", {}), Prompt("q", "No", {})
    sets = {"s1": (None, [yes, yes, yes, no]), "s2": (None, [yes, no, no, no, no])}
    r = majority(sets, mean_after=0.70)
    assert r["majority"] == [0.75, 0.8]
    assert r["above_majority"] is False  # 0.70 < (0.75 + 0.8) / 2
    assert majority(sets, mean_after=0.80)["above_majority"] is True
