from __future__ import annotations

import pickle
from dataclasses import fields

import numpy as np
import pytest

from asyncrl.trajectory import Trajectory, TrajectoryGroup, from_bytes, to_bytes


def make(i: int, r: int = 5) -> Trajectory:
    rng = np.random.default_rng(i)
    return Trajectory(
        traj_id=f"t{i}",
        group_id="g",
        prompt_ids=rng.integers(0, 50, 7),
        response_ids=rng.integers(0, 50, r),
        behaviour_logprobs=-rng.random(r),
        versions=np.array([3] * (r - 2) + [4, 4][: min(2, r)])[:r],
        loss_mask=np.ones(r, bool),
        reward=0.5,
        reward_breakdown={"exact": 1.0},
        response_text="12",
    )


def assert_same(a: Trajectory, b: Trajectory) -> None:
    """Every field equal, arrays of the same dtype."""
    for f in fields(Trajectory):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), f.name
        else:
            assert x == y, f.name


def test_roundtrip_exact_and_typed():
    trajs = [make(0), make(1, r=1)]
    for a, b in zip(trajs, from_bytes(to_bytes(trajs))):
        assert_same(a, b)


def test_group_pickles_through_msgpack_compactly():
    g = TrajectoryGroup("g", [make(i, r=200) for i in range(4)])
    data = pickle.dumps(g)
    back = pickle.loads(data)
    assert [t.traj_id for t in back.trajectories] == ["t0", "t1", "t2", "t3"]
    assert np.array_equal(
        back.trajectories[2].behaviour_logprobs, g.trajectories[2].behaviour_logprobs
    )
    # arrays travel as raw bytes: ~4 bytes per float, not a Python list repr
    assert len(data) < 4 * (200 * (4 + 4 + 4 + 1) + 7 * 4) + 2000


def test_versions_and_lengths_checked():
    t = make(0)
    assert (t.min_version, t.max_version) == (3, 4)
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        Trajectory("x", "g", [1], [1, 2], [0.0], [0, 0], [True, True], 0.0)


def test_columns_roundtrip_mixed_lengths_and_empty():
    trajs = [make(0, r=5), make(1, r=0), make(2, r=1), make(3, r=9)]
    trajs[1].error = "ValueError: boom"
    back = from_bytes(to_bytes(trajs))
    assert [t.traj_id for t in back] == ["t0", "t1", "t2", "t3"]
    for a, b in zip(trajs, back):
        assert_same(a, b)
    back[0].behaviour_logprobs[:] = 7.0  # decoded arrays are writable, and do not overlap
    assert_same(back[2], trajs[2])
    assert_same(back[3], trajs[3])
    assert from_bytes(to_bytes([])) == []


def test_arrays_that_are_not_per_token_go_record_by_record():
    t = make(0)
    t.prompt_ids = np.arange(6, dtype=np.int32).reshape(2, 3)  # e.g. a multi-modal prompt
    back = from_bytes(to_bytes([t, make(1)]))
    assert back[0].prompt_ids.shape == (2, 3) and np.array_equal(back[0].prompt_ids, t.prompt_ids)
    assert np.array_equal(back[1].response_ids, make(1).response_ids)


def test_images_travel_once_per_group_by_key_and_text_bytes_are_unchanged():
    from asyncrl.trajectory import Image

    text = [make(0), make(1)]
    plain = to_bytes(text)
    assert b"image" not in plain  # a text-only batch writes no image table or keys
    big, small = Image.of(bytes(range(256)) * 40), Image.of(b"\x89PNG tiny")
    shown = [make(i) for i in range(4)]
    for t in shown:
        t.images = [big, small]  # one group: the samples share the Image objects
    data = to_bytes(shown)
    assert len(plain) < len(data) < len(to_bytes([make(0), make(1), make(2), make(3)])) + 10_500
    back = from_bytes(data)
    assert [im.key for im in back[3].images] == [big.key, small.key]
    assert back[0].images[0] == big and back[0].images[0] is back[3].images[0]
    assert from_bytes(to_bytes([make(5)]))[0].images == []
    rec = make(9)
    rec.prompt_ids, rec.images = np.zeros((2, 2), np.int32), [small]  # record by record
    assert from_bytes(to_bytes([rec]))[0].images == [small]


def test_frames_travel_in_the_image_table_with_their_turns_none_kept():
    """Trajectory.frames (an env's picture after each turn): one table entry per
    distinct picture, each trajectory its keys in turn order, None where a turn had none."""
    from asyncrl.trajectory import Image

    a, b = Image.of(b"\x89PNG a"), Image.of(b"\x89PNG b")
    shown = [make(0), make(1)]
    shown[0].frames, shown[1].frames = [a, None, b], [a]
    back = from_bytes(to_bytes(shown))
    assert back[0].frames == [a, None, b] and back[1].frames == [a] and back[0].images == []
    assert back[0].frames[0] is back[1].frames[0]  # one object per key
    assert from_bytes(to_bytes([make(2)]))[0].frames == []
    rec = make(3)
    rec.prompt_ids, rec.frames = np.zeros((2, 2), np.int32), [None, b]  # record by record
    assert from_bytes(to_bytes([rec]))[0].frames == [None, b]
