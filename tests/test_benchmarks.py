"""The benchmark scripts run end to end with their smallest settings, print one JSON
object as their last stdout line and write their CSV and PNG. Values are checked
for sanity (present, finite, in range), never against speed targets: those live in
the scripts' own output."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncrl.losses.base import LossBatch, ModelOutputs
from asyncrl.losses.plain_pg import PlainPGLoss
from asyncrl.replay.buffer import GroupMeta, ReplayBuffer

ROOT = Path(__file__).parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks.common import finite_or_none, pin_tree, print_table, process_tree  # noqa: E402


def run_bench(name: str, out: Path, *args: str, timeout: int = 900) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    r = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--out", str(out), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    figures = json.loads(lines[-1])
    assert isinstance(figures, dict)
    assert (out / f"{name}.csv").is_file() and (out / f"{name}.png").stat().st_size > 0
    return figures


def finite(*xs) -> bool:
    return all(isinstance(x, int | float) and math.isfinite(x) for x in xs)


def test_queue_benchmark(tmp_path):
    f = run_bench("queue", tmp_path, "--batches", "2", "--rounds", "1", timeout=300)
    assert set(f) == {"queue_traj_per_s", "raw_traj_per_s", "ratio"}
    assert finite(*f.values())
    assert f["queue_traj_per_s"] > 0 and f["raw_traj_per_s"] > 0
    assert f["ratio"] == pytest.approx(f["queue_traj_per_s"] / f["raw_traj_per_s"])
    rows = list(csv.DictReader((tmp_path / "queue.csv").open()))
    assert {r["mode"] for r in rows} == {"queue", "raw"}
    assert all(int(r["trajectories"]) == 2 * 16 * 8 for r in rows)


@pytest.mark.slow
def test_actor_benchmark(tmp_path):
    engine_core = min(os.sched_getaffinity(0))  # the engine here, the actor elsewhere
    f = run_bench(
        "actor", tmp_path, "--prompts", "8", "--rounds", "1", "--min-tokens", "5",
        "--engine-cores", str(engine_core), "--io-threads-ab", "actor.sampling.max_tokens=7",
    )  # fmt: skip
    assert set(f) == {"actor_tokens_per_s", "vllm_tokens_per_s", "ratio",
                      "vllm_capped_tokens_per_s", "ratio_vs_capped", "ratio_per_round",
                      "ratio_median", "ratio_vs_capped_median", "placement",
                      "engine_cpu_ms_per_token", "engine_busy_cores",
                      "vllm_io_on_engine_tokens_per_s", "io_placement_gain",
                      "io_placement_gain_per_round"}  # fmt: skip
    placement = f.pop("placement")
    per_token, busy = f.pop("engine_cpu_ms_per_token"), f.pop("engine_busy_cores")
    assert placement["engine_cores"] == [engine_core]
    # the other cores; on a one-core machine both share it
    frontend = sorted(os.sched_getaffinity(0) - {engine_core}) or [engine_core]
    assert placement["frontend_cores"] == frontend
    # the engine-core process's I/O threads moved to the actor's cores (and back and
    # forth for the vllm_io_on_engine side)
    assert (placement["engine_io_threads"] > 0) == (frontend != [engine_core])
    # and every other process of the run (Ray's) off the engine's cores
    assert (placement["others_moved_threads"] > 0) == (frontend != [engine_core])
    gain_per_round = f.pop("io_placement_gain_per_round")
    assert finite(*gain_per_round) and len(gain_per_round) == 1
    assert f["io_placement_gain"] == pytest.approx(
        f["vllm_tokens_per_s"] / f["vllm_io_on_engine_tokens_per_s"]
    )
    per_round = f.pop("ratio_per_round")
    assert finite(*f.values(), *per_round)
    # one round: its own ratio is the whole run's
    assert per_round == [pytest.approx(f["ratio"])]
    assert f["ratio_median"] == pytest.approx(f["ratio"])
    assert f["ratio_vs_capped_median"] == pytest.approx(f["ratio_vs_capped"])
    assert f["actor_tokens_per_s"] > 0 and f["vllm_tokens_per_s"] > 0
    assert 0 < f["ratio"] < 10
    assert f["ratio"] == pytest.approx(f["actor_tokens_per_s"] / f["vllm_tokens_per_s"])
    rows = list(csv.DictReader((tmp_path / "actor.csv").open()))
    sides = {"asyncrl", "vllm", "vllm_capped", "vllm_io_on_engine"}
    assert {r["side"] for r in rows} == sides
    assert all(int(r["trajectories"]) == 8 * 8 for r in rows)  # 8 prompts x n=8 each side
    # --min-tokens holds on both sides: 5 to 7 tokens per sample (the task's are 2-3)
    assert all(5 * 64 <= int(r["tokens"]) <= 7 * 64 for r in rows), rows
    (mine,) = [r for r in rows if r["side"] == "asyncrl"]  # its queue calls are recorded
    assert 1 <= int(mine["handoff_calls"]) <= 8 and int(mine["acquire_calls"]) >= 1
    # the engine's CPU per token and busy cores, per side, are the CSV's (one round)
    assert set(per_token) == set(busy) == sides
    for r in rows:
        cpu = float(r["cpu_engine_s"])
        assert cpu > 0
        assert per_token[r["side"]] == pytest.approx(1000 * cpu / int(r["tokens"]))
        assert busy[r["side"]] == pytest.approx(cpu / float(r["seconds"]))


@pytest.mark.parametrize(
    "args, says",
    [
        (["--engine-cores", "os", "--io-threads-ab"], "give --engine-cores"),  # no split
        (["--prompts", "8", "--warmup-prompts", "9"], "--warmup-prompts must be in [0, "),
        (["--prompts", "8", "--warmup-prompts", "-1"], "--warmup-prompts must be in [0, "),
    ],
)
def test_actor_benchmark_refuses_bad_flags_before_starting(
    tmp_path, args, says, monkeypatch, capsys
):
    """Flags that cannot make a measurement stop the benchmark before it starts
    anything (exit 2), saying what is wrong: its argument parsing, run in-process with
    the command line it would get (``main`` parses before it starts anything)."""
    from benchmarks.actor import arguments

    monkeypatch.setattr(sys, "argv", ["actor", *args, "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        arguments()
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err, err[-2000:]
    assert not (tmp_path / "actor.csv").exists()


def test_actor_benchmark_places_the_engine_alone_by_default(monkeypatch):
    """--engine-cores auto: the config's placement if it sets one, else the engine on
    the lowest usable core when there are two or more, else the OS's; 'os' and a
    CPU list are taken as they are."""
    from benchmarks.actor import auto_engine_cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 5})
    assert auto_engine_cores("auto", None) == "3"
    assert auto_engine_cores("auto", "5") == "5"
    assert auto_engine_cores("os", "5") is None
    assert auto_engine_cores("1-2", None) == "1-2"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4})
    assert auto_engine_cores("auto", None) is None


@pytest.mark.slow
def test_engine_start_benchmark(tmp_path):
    """The three ways start, generate and are measured (forked, in-core, separate)."""
    f = run_bench("engine_start", tmp_path, "--rounds", "1", "--batches", "1")
    assert finite(*f.values())
    assert f["rounds"] == 1
    assert f["start_seconds_in_core"] > 0 and f["start_seconds_separate"] > 0
    assert f["tokens_per_s_in_core"] > 0 and f["tokens_per_s_separate"] > 0
    assert f["start_seconds_forked"] > 0 and f["tokens_per_s_forked"] > 0
    # the engine's processes hold torch and vLLM: hundreds of MB on every side
    assert all(f[f"engine_pss_mb_{s}"] > 100 for s in ("forked", "in_core", "separate")), f
    assert f["start_ratio"] == pytest.approx(
        f["start_seconds_separate"] / f["start_seconds_in_core"]
    )
    assert f["fork_start_ratio"] == pytest.approx(
        f["start_seconds_in_core"] / f["start_seconds_forked"]
    )
    rows = list(csv.DictReader((tmp_path / "engine_start.csv").open()))
    assert [r["side"] for r in rows] == ["forked", "in_core", "separate"]


@pytest.mark.slow
def test_throughput_benchmark(tmp_path):
    pin = [] if {0, 1} <= os.sched_getaffinity(0) else ["--no-pin"]
    f = run_bench("throughput", tmp_path, "--steps", "4", "--warmup", "1", *pin)
    keys = {"sync_seconds", "async_seconds", "speedup", "ideal_speedup", "efficiency",
            "actor_idle_frac", "learner_idle_frac", "tokens_per_s"}  # fmt: skip
    assert set(f) == keys
    assert finite(*f.values())
    assert f["sync_seconds"] > 0 and f["async_seconds"] > 0 and f["tokens_per_s"] > 0
    assert f["speedup"] == pytest.approx(f["sync_seconds"] / f["async_seconds"])
    assert 1 <= f["ideal_speedup"] <= 2 + 1e-9  # (g + t) / max(g, t)
    assert f["efficiency"] == pytest.approx(f["speedup"] / f["ideal_speedup"])
    assert 0 <= f["actor_idle_frac"] <= 1 and 0 <= f["learner_idle_frac"] <= 1
    rows = {r["mode"]: r for r in csv.DictReader((tmp_path / "throughput.csv").open())}
    # same samples (async may lose a few members of groups that spanned versions to the bound)
    assert 0.9 <= int(rows["async"]["samples_timed"]) / int(rows["sync"]["samples_timed"]) <= 1
    assert int(rows["sync"]["max_staleness"]) == 0 and int(rows["sync"]["dropped_stale"]) == 0


@pytest.mark.slow
def test_staleness_benchmark(tmp_path):
    f = run_bench(
        "staleness", tmp_path, "--steps", "10", "--ks", "0", "8", "--losses", "none", "--seeds", "0"
    )
    assert set(f) == {
        "reward",
        "retention_by_k",
        "retention_by_k_same_version",
        "retention_k8",
        "retention_k8_same_version",
        "start_reward",
        "gain_retention_k8",
    }
    assert 0 <= f["start_reward"] <= 1 and set(f["gain_retention_k8"]) == {"none"}
    assert set(f["reward"]) == {"none"} and set(f["reward"]["none"]) == {"0", "8"}
    assert all(0 <= v <= 1 for v in f["reward"]["none"].values())
    by_k = f["retention_by_k"]["none"]  # one seed: its own ratio, no spread
    assert set(by_k) == {"0", "8"} and by_k["0"]["mean"] == 1.0 and by_k["8"]["n"] == 1
    assert math.isclose(by_k["8"]["mean"], f["retention_k8"]["none"]) and by_k["8"]["std"] == 0
    same = f["retention_by_k_same_version"]["none"]
    assert same["8"]["n"] == 1 and finite(same["8"]["mean"])
    for key in ("retention_k8", "retention_k8_same_version"):
        assert set(f[key]) == {"none"} and finite(f[key]["none"]) and f[key]["none"] >= 0
    rows = list(csv.DictReader((tmp_path / "staleness.csv").open()))
    assert len(rows) == 2
    for r in rows:  # the delay really was exact: histogram {min(V, k)}, nothing dropped
        assert r["exact_staleness"] == "True", r
        assert int(r["max_staleness"]) == int(r["k"]) and int(r["dropped"]) == 0
        assert int(r["samples"]) == 10 * 16 * 8
        assert r["kl_target"] == "nan"  # no correction runs without the off-policy brake
        assert r["schedule"] == "cosine"  # the default's, recorded for --summarise
        assert float(r["grad_norm"]) > 0 and 0 <= float(r["grad_clip_frac"]) <= 1
        # version-0 samples: step 1 at k=0, steps 1-9 at k=8 (the ramp trains on them)
        assert int(r["start_samples"]) == (1 if r["k"] == "0" else 9) * 16 * 8
    curves = list(csv.DictReader((tmp_path / "curves.csv").open()))
    stale = [float(c["staleness"]) for c in curves if c["k"] == "8"]
    assert all(float(c["grad_norm"]) > 0 for c in curves)
    assert stale == [min(v, 8) for v in range(10)]
    # --summarise re-reports a finished sweep (its start reward rebuilt from the curves
    # when the rows lack it) without running anything, to the same figures
    (tmp_path / "old").mkdir()
    old_rows = [{k: v for k, v in r.items() if not k.startswith("start_")} for r in rows]
    with (tmp_path / "old" / "staleness.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(old_rows[0]))
        w.writeheader()
        w.writerows(old_rows)
    (tmp_path / "old" / "curves.csv").write_text((tmp_path / "curves.csv").read_text())
    again = run_bench(
        "staleness", tmp_path / "merged", "--summarise", str(tmp_path / "old"), str(tmp_path),
        timeout=120,
    )  # fmt: skip
    assert again["reward"] == f["reward"] and again["retention_k8"] == f["retention_k8"]
    assert math.isclose(again["start_reward"], f["start_reward"])


# ---- pieces the benchmarks rely on (fast) ---------------------------------------------------
def test_delay_mode_ramps_up_instead_of_waiting_at_version_0():
    buf = ReplayBuffer(max_staleness=3, batch_groups=1, delay_versions=3)

    def put(gid: str, version: int) -> None:
        buf.start()
        buf.put(gid, GroupMeta(gid, [gid + "-0"], [version], [4], [0.0]))

    for g in ("a", "b", "c", "d"):
        put(g, 0)
    got = []
    for v in range(5):
        buf.set_learner_version(v)
        if v >= 1:
            put(f"v{v}", v)
        item = buf.take(1)
        got.append(item[0].staleness[0] if item else None)
    assert got == [0, 1, 2, 3, 3]  # min(V, k): version-0 data while V < k, then exactly k


def test_plain_pg_ignores_behaviour_logprobs():
    torch.manual_seed(0)
    B, T = 3, 5
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:] = False
    adv = torch.randn(B, 1).expand(B, T).contiguous()
    w = mask.float() / mask.sum()
    logp = torch.randn(B, T).log_softmax(-1).requires_grad_()

    def loss_with(behaviour: torch.Tensor) -> torch.Tensor:
        batch = LossBatch(
            behaviour_logprobs=behaviour, versions=torch.zeros(B, T, dtype=torch.long), mask=mask,
            advantages=adv, loss_weights=w, rewards=torch.zeros(B),
            group_ids=torch.zeros(B, dtype=torch.long), learner_version=4,
        )  # fmt: skip
        out = PlainPGLoss()(batch, ModelOutputs(logprobs=logp))
        assert "is/ess" in out.metrics and "is/mismatch_kl" in out.metrics
        return out.loss

    on_policy, stale = loss_with(logp.detach()), loss_with(logp.detach() - 3.0)
    want = -(adv * logp * w)[mask].sum()
    assert torch.allclose(on_policy, want) and torch.allclose(stale, want)


def test_pin_tree_pins_every_thread_of_this_process():
    cores = os.sched_getaffinity(0)
    assert os.getpid() in process_tree(os.getpid())
    assert pin_tree(os.getpid(), cores) >= 1
    assert os.sched_getaffinity(0) == cores


def test_table_and_json_helpers(capsys):
    print_table("t", ["a", "b"], [["x", 1.23456], ["yy", float("nan")]])
    out = capsys.readouterr().out
    assert "1.235" in out and "yy" in out
    assert finite_or_none({"a": float("inf"), "b": [1.0, float("nan")]}) == {
        "a": None,
        "b": [1.0, None],
    }


def test_staleness_summarise_refuses_bad_input(tmp_path):
    """--summarise on a folder without a sweep, or on sweeps of different learning
    rates (one table would average them), stops with a message naming the problem."""
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.staleness", "--summarise", str(tmp_path / "none"),
         "--out", str(tmp_path / "out")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode != 0 and "no staleness.csv there" in r.stderr

    def summarise_one_run_sweeps(settings: dict[str, tuple[float, str]]):
        """One one-run sweep per name, at its (lr, schedule; "" writes no schedule
        column, as sweeps before it was recorded), then --summarise over them all."""
        dirs = []
        for name, (lr, sched) in settings.items():
            d = tmp_path / name
            d.mkdir()
            (d / "staleness.csv").write_text(
                "loss,k,seed,steps,samples,final_reward,start_reward,start_samples,lr"
                + (",schedule\n" if sched else "\n")
                + f"none,0,0,2,256,0.5,0.3,128,{lr}"
                + (f",{sched}\n" if sched else "\n")
            )
            (d / "curves.csv").write_text(
                "run,loss,k,seed,step,samples,reward\n0,none,0,0,1,128,0.3\n0,none,0,0,2,256,0.5\n"
            )
            dirs.append(str(d))
        return subprocess.run(
            [sys.executable, "-m", "benchmarks.staleness", "--summarise", *dirs,
             "--out", str(tmp_path / "out")],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    r = summarise_one_run_sweeps({"lr2": (2e-4, ""), "lr5": (5e-4, "")})
    assert r.returncode != 0 and "different settings (lr 0.0002" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "out").exists()  # nothing half-written
    # one peak LR, two schedules (a constant 5e-4 of 2026-11-30 and today's cosine)
    r = summarise_one_run_sweeps({"constant": (5e-4, "constant"), "cosine": (5e-4, "cosine")})
    assert r.returncode != 0 and "schedule constant" in r.stderr, r.stderr[-2000:]
    assert "schedule cosine" in r.stderr and not (tmp_path / "out").exists()
    # the off-policy brake: "none" runs without it beside braked losses (one sweep; a
    # k=0 row shared from "none" too), but two targets for one correction are two settings
    dirs = []
    for name, rows in {
        "a": [("none", "nan", ""), ("tis", "0.05", ""), ("mis", "nan", "none")],
        "b": [("decoupled_ppo", "0.05", "")],
        "c": [("decoupled_ppo", "0.1", "")],
    }.items():
        d = tmp_path / name
        d.mkdir()
        (d / "staleness.csv").write_text(
            "loss,k,seed,steps,samples,final_reward,same_version_reward,first_reward,"
            "start_reward,start_samples,ess,mismatch_kl,exact_staleness,lr,kl_target,"
            "shared_from\n"
            + "".join(
                f"{loss},0,0,2,256,0.5,0.5,0.3,0.3,128,1.0,0.0,True,0.0005,{t},{shared}\n"
                for loss, t, shared in rows
            )
        )
        (d / "curves.csv").write_text(
            "run,loss,k,seed,step,samples,reward\n"
            + "".join(f"{i},{r[0]},0,0,2,256,0.5\n" for i, r in enumerate(rows))
        )
        dirs.append(str(d))
    for got, ok in ((dirs[:2], True), (dirs[1:], False)):
        r = subprocess.run(
            [sys.executable, "-m", "benchmarks.staleness", "--summarise", *got,
             "--out", str(tmp_path / "out2")],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert (r.returncode == 0) == ok, r.stderr[-2000:]
    assert "mismatch_kl_target 0.05, 0.1" in r.stderr, r.stderr[-2000:]


def write_sweep(d: Path, runs, curve_run=lambda i: i, same=lambda r: r) -> str:
    """A finished sweep's staleness.csv and curves.csv, written by hand: runs are
    (loss, k, seed, final reward, shared_from); each run's curve has two steps, the
    second at its final reward. ``curve_run(i)``: the run number its curve carries;
    ``same(r)``: the same-version reward of a run whose final reward is ``r``."""
    d.mkdir()
    (d / "staleness.csv").write_text(
        "loss,k,seed,steps,samples,final_reward,same_version_reward,first_reward,"
        "start_reward,start_samples,ess,mismatch_kl,exact_staleness,lr,kl_target,shared_from\n"
        + "".join(
            f"{loss},{k},{seed},2,256,{r},{same(r)},0.3,0.3,128,1.0,0.0,True,0.0003,0.05,{sh}\n"
            for loss, k, seed, r, sh in runs
        )
    )
    (d / "curves.csv").write_text(
        "run,loss,k,seed,step,samples,reward\n"
        + "".join(
            f"{curve_run(i)},{loss},{k},{seed},1,128,0.3\n"
            f"{curve_run(i)},{loss},{k},{seed},2,256,{r}\n"
            for i, (loss, k, seed, r, _) in enumerate(runs)
        )
    )
    return str(d)


def test_staleness_retention_by_k_over_seeds(tmp_path):
    """retention_by_k: every k swept, each seed's reward(k) / reward(k=0), then mean, sample
    std, min, max and n over the seeds; a seed without its k=0 run does not count, a loss
    with none has nulls; the plot is written."""
    runs = [  # loss, k, seed, final reward, shared_from
        ("tis", 0, 0, 0.6, ""), ("tis", 2, 0, 0.54, ""), ("tis", 8, 0, 0.5, ""),
        ("tis", 0, 1, 0.7, ""), ("tis", 2, 1, 0.7, ""), ("tis", 8, 1, 0.56, ""),
        ("tis", 8, 2, 0.1, ""),  # seed 2 has no k=0: left out
        ("mis", 8, 0, 0.5, ""),
    ]  # fmt: skip
    f = run_bench("staleness", tmp_path / "out", "--summarise", write_sweep(tmp_path / "s", runs))
    tis = f["retention_by_k"]["tis"]
    assert set(tis) == {"0", "2", "8"}
    assert tis["0"] == {"mean": 1.0, "std": 0.0, "min": 1.0, "max": 1.0, "n": 2}
    k8 = [0.5 / 0.6, 0.56 / 0.7]
    assert tis["8"]["n"] == 2 and math.isclose(tis["8"]["mean"], sum(k8) / 2)
    assert math.isclose(tis["8"]["std"], abs(k8[0] - k8[1]) / math.sqrt(2))
    assert math.isclose(tis["8"]["min"], min(k8)) and math.isclose(tis["8"]["max"], max(k8))
    assert math.isclose(tis["2"]["mean"], (0.9 + 1.0) / 2)
    assert f["retention_by_k"]["mis"]["8"] == {
        "mean": None, "std": None, "min": None, "max": None, "n": 0
    }  # fmt: skip
    assert (tmp_path / "out" / "staleness.png").stat().st_size > 0


def test_staleness_retention_by_k_of_the_same_version_reward(tmp_path):
    """retention_by_k_same_version: the same figures as retention_by_k, of each run's
    same-version reward instead of its final one."""
    runs = [("tis", 0, 0, 0.6, ""), ("tis", 8, 0, 0.5, ""),
            ("tis", 0, 1, 0.7, ""), ("tis", 8, 1, 0.56, "")]  # fmt: skip
    sweep = write_sweep(tmp_path / "s", runs, same=lambda r: round(r + 0.1, 3))
    f = run_bench("staleness", tmp_path / "out", "--summarise", sweep)
    k8 = [0.6 / 0.7, 0.66 / 0.8]
    same = f["retention_by_k_same_version"]["tis"]
    assert same["0"]["mean"] == 1.0 and same["8"]["n"] == 2
    assert math.isclose(same["8"]["mean"], sum(k8) / 2)
    assert math.isclose(same["8"]["min"], min(k8)) and math.isclose(same["8"]["max"], max(k8))
    final = f["retention_by_k"]["tis"]["8"]["mean"]
    assert math.isclose(final, (0.5 / 0.6 + 0.56 / 0.7) / 2)


def test_staleness_summarise_shares_a_missing_k0(tmp_path):
    """--summarise --share-k0: masked IS swept at k=8 alone is rated against the seed's
    k=0 of decoupled PPO (the same update on-policy); V-trace never borrows one, and
    without the flag nothing is filled in."""
    dirs = [
        write_sweep(tmp_path / "dppo", [("decoupled_ppo", 0, 0, 0.6, ""),
                                        ("decoupled_ppo", 8, 0, 0.57, "")]),
        write_sweep(tmp_path / "mis", [("mis", 8, 0, 0.54, ""), ("vtrace", 8, 0, 0.5, "")]),
    ]  # fmt: skip
    plain = run_bench("staleness", tmp_path / "plain", "--summarise", *dirs, timeout=120)
    assert plain["retention_k8"]["mis"] is None  # no k=0 for masked IS: nothing to rate
    f = run_bench(
        "staleness", tmp_path / "out", "--summarise", *dirs, "--share-k0", timeout=120
    )  # fmt: skip
    assert f["reward"]["mis"]["0"] == 0.6 and math.isclose(f["retention_k8"]["mis"], 0.54 / 0.6)
    assert f["retention_k8"]["vtrace"] is None  # V-trace's k=0 is its own, never shared
    assert f["retention_k8"] == {**plain["retention_k8"], "mis": f["retention_k8"]["mis"]}
    rows = list(csv.DictReader((tmp_path / "out" / "staleness.csv").open()))
    copy = [r for r in rows if r["loss"] == "mis" and r["k"] == "0"]
    assert len(copy) == 1 and copy[0]["shared_from"] == "decoupled_ppo"
    curves = list(csv.DictReader((tmp_path / "out" / "curves.csv").open()))
    assert [c["reward"] for c in curves if c["loss"] == "mis" and c["k"] == "0"] == ["0.3", "0.6"]
    assert math.isclose(f["start_reward"], plain["start_reward"])  # a copy is not a new run


def test_staleness_summarise_picks_runs_and_keeps_shared_curves(tmp_path):
    """--summarise --seeds/--ks/--losses reports only those runs (renumbered, so the
    merged files load again), and a k=0 copy that an older sweep wrote with its source
    run's number in curves.csv keeps its curve."""
    runs = [  # loss, k, seed, final reward, shared_from; none's k=0 shared with tis
        ("none", 0, 0, 0.6, ""), ("tis", 0, 0, 0.6, "none"), ("tis", 8, 0, 0.5, ""),
        ("none", 0, 1, 0.7, ""), ("tis", 0, 1, 0.7, "none"), ("tis", 8, 1, 0.56, ""),
    ]  # fmt: skip
    source = {1: 0, 4: 3}  # the copies' curves carry their source's run, as sweeps did
    d = write_sweep(tmp_path / "sweep", runs, lambda i: source.get(i, i))
    f = run_bench("staleness", tmp_path / "one", "--summarise", d, "--seeds", "1")
    assert f["reward"] == {"none": {"0": 0.7, "8": None}, "tis": {"0": 0.7, "8": 0.56}}
    rows = list(csv.DictReader((tmp_path / "one" / "staleness.csv").open()))
    assert [(r["loss"], r["seed"], r["run"]) for r in rows] == [
        ("none", "1", "0"), ("tis", "1", "1"), ("tis", "1", "2")
    ]  # fmt: skip
    curves = list(csv.DictReader((tmp_path / "one" / "curves.csv").open()))
    assert {(c["run"], c["loss"], c["k"]) for c in curves} == {
        ("0", "none", "0"),
        ("1", "tis", "0"),
        ("2", "tis", "8"),
    }  # tis's k=0 copy kept its curve
    again = run_bench("staleness", tmp_path / "again", "--summarise", str(tmp_path / "one"))
    assert again["reward"] == f["reward"]  # the picked, renumbered files load again
    f = run_bench("staleness", tmp_path / "k8", "--summarise", d, "--ks", "8")
    assert list(f["reward"]) == ["tis"] and list(f["reward"]["tis"]) == ["8"]
    assert math.isclose(f["reward"]["tis"]["8"], 0.53)  # both seeds
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.staleness", "--summarise", d, "--seeds", "7",
         "--out", str(tmp_path / "none")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode != 0 and "no run matches" in r.stderr


def test_staleness_sweep_shares_k0_with_its_own_run_numbers(monkeypatch, tmp_path):
    """--share-k0 in a sweep: k=0 runs once per seed and the other same-on-policy losses
    get copies whose curves carry the copy's own run number (its row's place)."""
    import argparse

    from benchmarks import staleness

    ran = []

    class FakeRunner:  # the Ray/vLLM side of a run, faked at that boundary
        def __init__(self, *a, **kw):
            pass

        def run(self, loss, k, seed):
            ran.append((loss, k, seed))
            step = {"step": 1, "reward/count": 128, "reward/mean": 0.5, "staleness/mean": 0}
            return {"loss": loss, "k": k, "seed": seed, "final_reward": 0.5, "seconds": 0}, [step]

        def close(self):
            pass

    monkeypatch.setattr(staleness, "Runner", FakeRunner)
    monkeypatch.setattr(staleness, "start_ray", lambda: None)
    # nor stop one: the session's Ray (conftest's ray_local) serves the tests after this
    monkeypatch.setattr("ray.shutdown", lambda: None)
    args = argparse.Namespace(overrides=[], out=tmp_path)
    rows, curves = staleness.sweep(args, 1, [0, 8], ["none", "tis", "vtrace"], [0, 1], True)
    assert [x for x in ran if x[1] == 0] == [("none", 0, 0), ("vtrace", 0, 0), ("none", 0, 1),
                                             ("vtrace", 0, 1)]  # fmt: skip
    assert [r.get("shared_from") for r in rows if r["loss"] == "tis" and r["k"] == 0] == [
        "none",
        "none",
    ]
    for i, r in enumerate(rows):  # every row has exactly its own curve, numbered by place
        mine = [c for c in curves if c["run"] == i]
        assert [(c["loss"], c["k"], c["seed"]) for c in mine] == [(r["loss"], r["k"], r["seed"])]


def test_no_correction_runs_without_the_off_policy_brake():
    from benchmarks.staleness import Runner

    runner = Runner(["learner.optim.mismatch_kl_target=0.1"], 10, Path("."), 8)
    assert runner.config("none", 8, 0).learner.optim.mismatch_kl_target is None
    assert runner.config("tis", 8, 0).learner.optim.mismatch_kl_target == 0.1
    clipped = runner.config("clipped", 8, 0)  # the training job's default loss, swept too
    assert clipped.loss._target_ == "asyncrl.losses.clipped.ClippedISLoss"
    assert clipped.learner.optim.mismatch_kl_target == 0.1
    assert (
        Runner([], 10, Path("."), 8)
        .config("decoupled_ppo", 8, 0)
        .learner.optim["mismatch_kl_target"]
        == 0.05
    )  # the default config's brake


def test_staleness_overrides_of_one_loss(tmp_path):
    """An override of one loss's settings (loss.behaviour_cap) is refused before
    anything starts when the sweep has a loss it does not fit (it used to stop the
    sweep at that loss's first run), and fits the report of a sweep of that loss
    alone (the report used to compose the config without the loss, and failed after
    all runs had finished)."""
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.staleness", "--losses", "none", "decoupled_ppo",
         "--out", str(tmp_path / "out"), "loss.behaviour_cap=2.0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "do not fit loss none" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "out").exists()

    d = tmp_path / "sweep"
    d.mkdir()
    (d / "staleness.csv").write_text(
        "loss,k,seed,steps,samples,final_reward,same_version_reward,first_reward,"
        "start_reward,start_samples,ess,mismatch_kl,exact_staleness,lr\n"
        "decoupled_ppo,0,0,2,256,0.5,0.5,0.3,0.3,128,1.0,0.0,True,0.0005\n"
        "decoupled_ppo,8,0,2,256,0.4,0.4,0.3,0.3,128,0.7,0.2,True,0.0005\n"
    )
    (d / "curves.csv").write_text(
        "run,loss,k,seed,step,samples,reward\n"
        "0,decoupled_ppo,0,0,1,128,0.3\n0,decoupled_ppo,0,0,2,256,0.5\n"
        "1,decoupled_ppo,8,0,1,128,0.3\n1,decoupled_ppo,8,0,2,256,0.4\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.staleness", "--summarise", str(d),
         "--out", str(tmp_path / "report"), "loss.behaviour_cap=2.0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    f = json.loads(r.stdout.strip().splitlines()[-1])
    assert f["retention_k8"]["decoupled_ppo"] == pytest.approx(0.8)
