"""benchmarks/chaos.py's own logic, without a run: finding victims by title in a
process tree, and the accounting figure."""

from __future__ import annotations

import subprocess
import time

from benchmarks.chaos import role_pids, unaccounted


def test_role_pids_finds_titles_in_the_tree_only():
    # a parent whose children carry the titles Ray and vLLM give their processes
    script = (
        "(exec -a 'ray::RolloutActor' sleep 30) & (exec -a 'VLLM::EngineCore' sleep 30) & "
        "(exec -a 'ray::Learner.train_step' sleep 30) & (exec -a 'ray::LearnerX' sleep 30) & wait"
    )
    tree = subprocess.Popen(["bash", "-c", script])
    stranger = subprocess.Popen(["bash", "-c", "exec -a 'ray::RolloutActor' sleep 30"])
    try:
        # the four children exec in any order: wait for each role, not the first one
        deadline = time.time() + 10
        while time.time() < deadline and not all(
            role_pids(tree.pid, role) for role in ("actor", "engine", "learner")
        ):
            time.sleep(0.05)
        assert len(role_pids(tree.pid, "actor")) == 1
        assert len(role_pids(tree.pid, "engine")) == 1
        learner = role_pids(tree.pid, "learner")  # not ray::LearnerX
        assert len(learner) == 1
        assert stranger.pid not in role_pids(tree.pid, "actor")  # outside the tree
    finally:
        for p in (tree, stranger):
            subprocess.run(["pkill", "-KILL", "-P", str(p.pid)], check=False)
            p.kill()
            p.wait()


def test_unaccounted_counts_every_drop():
    # a learner restart's drops are inside dropped_stale (fault/learner.py): not again
    s = {
        "trajectories_produced": 100,
        "trajectories_trained": 80,
        "trajectories_dropped_stale": 12,
        "trajectories_dropped_restart": 4,
        "trajectories_in_flight": 8,
    }
    assert unaccounted(s) == 0
    assert unaccounted({**s, "trajectories_trained": 79}) == 1
    assert unaccounted({}) is None
