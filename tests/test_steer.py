"""replay.max_staleness=auto: the steer (asyncrl/replay/steer.py) on synthetic metric
streams, its settings' refusals, and the queue under a bound that moves (the real
ReplayQueueCore, Ray's boundary faked: never a sample staler than the bound in force,
accounting exact at every moment)."""

from __future__ import annotations

import asyncio
import math
import random

import pytest
from replay_fakes import hand_off

from asyncrl.config import ConfigError
from asyncrl.replay.buffer import GroupMeta
from asyncrl.replay.queue import ReplayQueueCore
from asyncrl.replay.settings import ReplaySettings
from asyncrl.replay.steer import Bands, BoundChange, StalenessSteer

BANDS = Bands(ess_widen=0.9, ess_narrow=0.8, kl_widen=0.02, kl_narrow=0.05)
HEALTHY = {"is/ess": 0.97, "is/mismatch_kl": 0.004}
HOLD = {"is/ess": 0.85, "is/mismatch_kl": 0.03}  # between the bands on both metrics
LOW_ESS = {"is/ess": 0.6, "is/mismatch_kl": 0.01}
HIGH_KL = {"is/ess": 0.95, "is/mismatch_kl": 0.2}


def steer(floor=1, ceiling=8, widen_after=3, narrow_after=2) -> StalenessSteer:
    return StalenessSteer(floor, ceiling, BANDS, widen_after, narrow_after)


def feed(s: StalenessSteer, stream) -> list[tuple[int, BoundChange]]:
    """(step, change) for every change the stream caused; the bound checked each step."""
    out = []
    for step, m in enumerate(stream, start=1):
        change = s.observe(step, m)
        assert s.floor <= s.bound <= s.ceiling
        if change is not None:
            assert change.max_staleness == s.bound and change.step == step
            out.append((step, change))
    return out


def test_a_healthy_stream_widens_one_at_a_time_up_to_the_ceiling():
    s = steer(floor=1, ceiling=5, widen_after=3)
    changes = feed(s, [HEALTHY] * 40)
    assert [c.max_staleness for _, c in changes] == [2, 3, 4, 5]
    assert [step for step, _ in changes] == [3, 6, 9, 12]  # a widening is earned again
    assert s.bound == 5 and s.changes == [c for _, c in changes]
    for _, c in changes:
        assert c.kind == "bound_change"
        assert "is/ess 0.97 >= 0.9 and is/mismatch_kl 0.004 <= 0.02 for 3 steps" in c.reason
    assert changes[0][1].reason.startswith("1 -> 2: ")


@pytest.mark.parametrize(
    "bad,why", [(LOW_ESS, "is/ess 0.6 < 0.8"), (HIGH_KL, "is/mismatch_kl 0.2 > 0.05")]
)
def test_a_degraded_stream_halves_the_bound_down_to_the_floor(bad, why):
    s = steer(floor=1, ceiling=8, widen_after=1)
    feed(s, [HEALTHY] * 7)
    assert s.bound == 8
    changes = feed(s, [bad] * 20)
    assert [c.max_staleness for _, c in changes] == [4, 2, 1]
    assert [step for step, _ in changes] == [2, 4, 6]  # narrow_after=2 degraded steps each
    assert all(f"{why} for 2 steps" in c.reason for _, c in changes)
    assert changes[0][1].reason.startswith("8 -> 4: ")


def test_not_finite_metrics_degrade_and_missing_ones_hold():
    s = steer(floor=0, ceiling=4, widen_after=1, narrow_after=1)
    feed(s, [HEALTHY] * 4)
    (_, c), = feed(s, [{"is/ess": math.nan, "is/mismatch_kl": 0.01}])  # fmt: skip
    assert c.max_staleness == 2 and "not finite" in c.reason
    assert feed(s, [{}, {"reward/mean": 0.5}] * 5) == []  # no IS metrics: no evidence


def test_hysteresis_the_bound_does_not_flap():
    s = steer(floor=1, ceiling=8, widen_after=3, narrow_after=2)
    assert feed(s, [HOLD] * 50) == []  # wandering between the bands moves nothing
    assert feed(s, [HEALTHY, LOW_ESS] * 25) == []  # no streak lasts
    assert feed(s, [HEALTHY, HEALTHY, HOLD] * 20) == []  # a hold step resets the streak
    # just either side of one threshold (ESS 0.89 / 0.91): inside the band, no change
    near = [{"is/ess": 0.89 + 0.02 * (i % 2), "is/mismatch_kl": 0.03} for i in range(50)]
    assert feed(s, near) == []


def test_a_plant_whose_health_falls_with_the_bound_settles_without_oscillating():
    """ESS falls and KL rises with the bound (a synthetic run): the bound climbs to the
    first value where the step leaves the healthy band, then holds there."""
    s = steer(floor=1, ceiling=16, widen_after=3)
    history = []
    for step in range(1, 200):
        m = {"is/ess": 1.0 - 0.03 * s.bound, "is/mismatch_kl": 0.004 * s.bound}
        s.observe(step, m)
        history.append(s.bound)
    assert history[-1] == 4  # ESS 0.88 at 4: between the bands, it holds
    assert history == sorted(history)  # it only ever widened: no oscillation
    assert len(s.changes) == 3


def test_random_streams_keep_the_bound_within_floor_and_ceiling():
    rng = random.Random(0)
    s = steer(floor=2, ceiling=6, widen_after=2, narrow_after=1)
    kinds = [HEALTHY, HOLD, LOW_ESS, HIGH_KL]
    stream = [rng.choices(kinds, weights=[6, 1, 1, 1])[0] for _ in range(500)]
    changes = feed(s, stream)
    assert changes and all(2 <= c.max_staleness <= 6 for _, c in changes)
    assert all(c.reason for _, c in changes)


def test_from_settings():
    assert StalenessSteer.from_settings(ReplaySettings.defaults()) is None  # a fixed bound
    s = StalenessSteer.from_settings(
        ReplaySettings.defaults(max_staleness="auto", auto_floor=2, auto_ceiling=5)
    )
    assert (s.floor, s.ceiling, s.bound) == (2, 5, 2)


@pytest.mark.parametrize(
    "values,names",
    [
        ({"max_staleness": "sometimes"}, "replay.max_staleness='sometimes': expected an integer"),
        ({"max_staleness": 2.5}, "replay.max_staleness=2.5: expected one of the types"),
        ({"max_staleness": "auto", "auto_floor": 5, "auto_ceiling": 3}, "replay.auto_floor=5"),
        ({"auto_ess_narrow": 0.9, "auto_ess_widen": 0.9}, "replay.auto_ess_narrow=0.9 must be"),
        ({"auto_kl_narrow": 0.01}, "replay.auto_kl_narrow=0.01 must be above"),
        ({"auto_ess_widen": 1.5}, "replay.auto_ess_widen=1.5"),
        ({"auto_widen_after": 0}, "replay.auto_widen_after=0"),
        ({"auto_floor": -1}, "replay.auto_floor=-1"),
        ({"auto_ceiling": 2.5}, "replay.auto_ceiling=2.5: expected an integer"),
        (
            {"max_staleness": "auto", "delay_versions": 2},
            "replay.delay_versions=2 exceeds replay.auto_floor=1",
        ),
    ],
)
def test_bad_auto_settings_are_refused_naming_the_key(values, names):
    with pytest.raises(ConfigError, match="^" + names.split(":")[0].replace(".", r"\.")) as e:
        ReplaySettings.defaults(**values)
    assert names in str(e.value) and "\n" not in str(e.value)


def test_the_queue_starts_at_the_floor_and_reports_its_bound():
    s = ReplaySettings.defaults(max_staleness="auto", auto_floor=3, auto_ceiling=7)
    assert s.buffer_kwargs(4)["max_staleness"] == 3 and s.highest_bound == 7
    stats = ReplayQueueCore(**s.buffer_kwargs(4)).stats()
    assert (stats["max_staleness"], stats["highest_bound"], stats["bound_changes"]) == (3, 3, 0)


# ---- the queue under a moving bound -------------------------------------------------------
def meta(gid: str, versions: list[int]) -> GroupMeta:
    n = len(versions)
    return GroupMeta(gid, [f"{gid}-{i}" for i in range(n)], versions, [10] * n, [0.0] * n)


def exact(q: ReplayQueueCore) -> dict:
    s = q.stats()
    assert s["produced"] == s["trained"] + s["dropped_stale"] + s["in_flight"], s
    return s


def test_narrowing_drops_at_once_what_it_makes_stale():
    async def main():
        q = ReplayQueueCore(max_staleness=4, batch_groups=1, policy="drop")
        for i, v in enumerate([0, 2, 3, 5]):
            assert await q.acquire(0.1)
            await q.hand_over(hand_off([meta(f"g{i}", [v, v])], key=i))
        await q.set_learner_version(5)  # version 0 is stale: dropped at the next take
        assert exact(q)["dropped_stale"] == 0
        assert await q.set_max_staleness(BoundChange(1, "test", 5)) == 6  # versions 0, 2, 3
        s = exact(q)
        assert (s["dropped_stale"], s["in_flight"], s["max_staleness"]) == (6, 2, 1)
        (item,) = await q.get_batch(1, 5, timeout_s=0.1)
        assert item.group_id == "g3" and item.staleness == [0, 0]
        assert await q.set_max_staleness(BoundChange(3, "test", 6)) == 0
        s = exact(q)
        assert (s["bound_changes"], s["highest_bound"], s["max_staleness"]) == (2, 4, 3)

    asyncio.run(main())


def test_widening_wakes_actors_held_by_the_throttle_window():
    async def main():
        # bound 0, one group a batch: the window holds (0 + 0 + 1) x 1 = 1 group
        q = ReplayQueueCore(max_staleness=0, batch_groups=1, capacity_groups=0)
        assert await q.acquire_many(5, 0.1) == 1
        waiting = asyncio.ensure_future(q.acquire(2.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await q.set_max_staleness(BoundChange(2, "test", 0))  # window: 3 groups
        assert await waiting is True
        assert await q.acquire_many(5, 0.1) == 1
        assert q.buf.capacity_groups == (2 + 2) * 1  # capacity follows the bound
        await q.close()

    asyncio.run(main())


def test_a_moving_bound_never_lets_out_a_sample_staler_than_the_bound_in_force():
    """Random hand-offs, versions and bound changes (up and down) interleaved on the
    queue's one event loop: every batch's staleness is within the bound in force when
    it was taken, and produced = trained + dropped_stale + in_flight after every call."""

    async def main():
        rng = random.Random(1)
        q = ReplayQueueCore(max_staleness=2, batch_groups=2, policy="drop", capacity_groups=10**6)
        version, bound, key, taken = 0, 2, 0, 0
        for step in range(400):
            for _ in range(rng.randint(0, 3)):
                await q.acquire(0.1)
                lo = max(0, version - rng.randint(0, 8))
                versions = [rng.randint(lo, version) for _ in range(3)]
                await q.hand_over(hand_off([meta(f"g{key}", versions)], key=key))
                key += 1
                exact(q)
            if rng.random() < 0.2:
                bound = rng.randint(0, 6)
                await q.set_max_staleness(BoundChange(bound, "random", version))
                exact(q)
            items = await q.get_batch(2, version, timeout_s=0.001)
            for it in items or []:
                assert max(it.staleness) <= bound, (step, bound, it)
                taken += 1
            exact(q)
            if rng.random() < 0.5:
                version += 1
                await q.set_learner_version(version)
        s = exact(q)
        assert taken > 50 and s["dropped_stale"] > 0 and s["bound_changes"] > 10

    asyncio.run(main())


@pytest.mark.parametrize(
    "overrides,names",
    [
        (["replay.max_staleness=sometimes"], "replay.max_staleness='sometimes': expected an"),
        (
            ["replay.max_staleness=auto", "replay.auto_floor=5", "replay.auto_ceiling=3"],
            "replay.auto_floor=5 exceeds replay.auto_ceiling=3",
        ),
        (["replay.auto_kl_narrow=0.01"], "replay.auto_kl_narrow=0.01 must be above"),
    ],
)
def test_the_run_refuses_bad_auto_settings_before_ray(
    overrides, names, tmp_path, capsys, monkeypatch
):
    from helpers import refused_before_ray

    from asyncrl.config import compose_config

    cfg = compose_config([*overrides, "progress=false"])
    assert names in refused_before_ray(cfg, tmp_path, capsys, monkeypatch)
