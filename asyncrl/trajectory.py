"""The trajectory: one completion of one prompt, with everything the learner needs.

Per-token arrays are numpy and all have the response length ``R``:

* ``response_ids``     int32 [R]  sampled tokens
* ``behaviour_logprobs`` float32 [R]  log-prob of each sampled token under the
  distribution vLLM sampled from (processed: after temperature / top-k / top-p)
* ``versions``         int32 [R]  policy version that produced each token (a sequence
  may span versions when weights change in flight)
* ``loss_mask``        bool  [R]  True for tokens the learner trains on (env/tool tokens False)

``routed_experts`` (mixture-of-experts models, optional) is uint8 ``[n, layers, top_k]``:
the experts the engine's router chose for the token at each of the first ``n`` positions
of prompt + response as model input, ``n <= num_tokens`` (vLLM's
``CompletionOutput.routed_experts`` layout); the engine records them with
``actor.record_experts`` (asyncrl/engine/experts.py), the learner replays them with
``learner.moe.routing_replay`` (asyncrl/learner/routing.py).

A multi-turn episode (asyncrl/actor/env_runner.py) is one trajectory: its response holds
every turn's generated tokens (mask True) and the observations between them (mask
False, behaviour log-prob 0, the version of the generated token before them).
Staleness is over generated tokens only (``min_version``/``max_version``).

A group (all samples of one prompt) travels as one object: the actor ``ray.put``s
it once and only the reference moves through the queue.

Images (a prompt's or an observation's, PNG bytes): ``images`` lists the
:class:`Image` s a trajectory's ids show, in the order their placeholder tokens appear
in prompt + response (an observation's image tokens are response tokens outside the
loss mask). The samples of one group share the same :class:`Image` objects for their
prompt (never copied per sample or per step); :func:`to_bytes` writes each distinct image once (a table
keyed by :attr:`Image.key`) and every trajectory only its keys. A text-only batch
writes no table: its bytes are what they are without images.

Frames (``frames``): an env's picture after each turn (``StepResult.frame``, a
browser page's screenshot), None where a step gave none; the log and the report show
them beside the turns, the model and the learner never read them. They travel in the
same table as ``images``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import msgpack
import numpy as np

_ARRAY_FIELDS = {
    "prompt_ids": np.int32,
    "response_ids": np.int32,
    "behaviour_logprobs": np.float32,
    "versions": np.int32,
    "loss_mask": np.bool_,
}


@dataclass(frozen=True)
class Image:
    """One image as PNG bytes, named by ``key`` (a hash of the bytes: equal bytes, one
    key, stored once)."""

    key: str
    png: bytes

    @classmethod
    def of(cls, png: bytes) -> Image:
        return cls(hashlib.blake2b(png, digest_size=8).hexdigest(), bytes(png))


@dataclass
class Trajectory:
    traj_id: str  # unique across the run, for accounting
    group_id: str  # shared by the samples of one prompt
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    behaviour_logprobs: np.ndarray
    versions: np.ndarray
    loss_mask: np.ndarray
    reward: float
    reward_breakdown: dict[str, float] = field(default_factory=dict)
    finish_reason: str = ""
    error: str = ""  # set when the reward function raised; the reward is then 0
    prompt_text: str = ""
    response_text: str = ""
    t_start: float = 0.0  # wall-clock seconds (time.time) when generation started
    t_end: float = 0.0  # ... when the completion was scored
    # multi-turn episodes only (else empty): turns, tool_calls, and over the turns'
    # requests turn_prompt_tokens and cached_tokens (the prefix cache's hits), and
    # env_seconds (awaiting the env's steps)
    episode: dict[str, float] = field(default_factory=dict)
    # the images the prompt's and observations' ids show, in placeholder order (a prompt's
    # shared by the group's samples)
    images: list[Image] = field(default_factory=list)
    routed_experts: np.ndarray | None = None  # uint8 [n, layers, top_k], n <= num_tokens
    # the env's picture after each turn (None: that step gave none); empty: no step did
    frames: list[Image | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name, dtype in _ARRAY_FIELDS.items():
            setattr(self, name, np.asarray(getattr(self, name), dtype=dtype))
        if self.routed_experts is not None:
            self.routed_experts = np.asarray(self.routed_experts, dtype=np.uint8)
            if self.routed_experts.ndim != 3 or len(self.routed_experts) > self.num_tokens:
                raise ValueError(
                    f"routed_experts has shape {self.routed_experts.shape}, expected "
                    f"[n <= {self.num_tokens}, layers, top_k]"
                )
        r = len(self.response_ids)
        for name in ("behaviour_logprobs", "versions", "loss_mask"):
            if len(getattr(self, name)) != r:
                raise ValueError(f"{name} has length {len(getattr(self, name))}, response has {r}")

    def _generated_versions(self) -> np.ndarray:
        """Versions of the tokens the policy generated (all, if the mask trains none)."""
        v = self.versions[self.loss_mask]
        return v if len(v) else self.versions

    @property
    def min_version(self) -> int:
        """Oldest version among the generated tokens (the one staleness is measured
        from; observation tokens carry none of their own)."""
        v = self._generated_versions()
        return int(v.min()) if len(v) else 0

    @property
    def max_version(self) -> int:
        v = self._generated_versions()
        return int(v.max()) if len(v) else 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def _pack(obj):
    if isinstance(obj, np.ndarray):
        return {"__nd__": True, "d": obj.dtype.str, "s": list(obj.shape), "b": obj.tobytes()}
    if isinstance(obj, Image):
        return {"__img__": obj.key, "png": obj.png}
    raise TypeError(f"cannot serialise {type(obj)}")


def _unpack(obj):
    if obj.get("__nd__"):
        return np.frombuffer(obj["b"], dtype=np.dtype(obj["d"])).reshape(obj["s"]).copy()
    if "__img__" in obj:
        return Image(obj["__img__"], obj["png"])
    return obj


_SCALAR_FIELDS = [
    f.name for f in fields(Trajectory) if f.name not in {*_ARRAY_FIELDS, "images", "frames"}
]


def token_fields(
    prompt_ids: Sequence[int], ids: Sequence[int], logprobs: Sequence[float],
    versions: Sequence[int], mask: Sequence[bool],
) -> dict[str, np.ndarray]:  # fmt: skip
    """A :class:`Trajectory`'s token arrays, with its dtypes, from flat per-token lists
    (``Trajectory(traj_id=..., **token_fields(...), ...)``)."""
    return {
        "prompt_ids": np.asarray(prompt_ids, dtype=np.int32),
        "response_ids": np.asarray(ids, dtype=np.int32),
        "behaviour_logprobs": np.asarray(logprobs, dtype=np.float32),
        "versions": np.asarray(versions, dtype=np.int32),
        "loss_mask": np.asarray(mask, dtype=bool),
    }


def to_bytes(trajs: list[Trajectory]) -> bytes:
    """msgpack of the trajectories; arrays travel as raw bytes, never lists of floats.

    Column by column (one list per scalar field, one concatenated buffer per array
    field): a group of 8 encoded in about a third of the time one record per trajectory
    took, and the actor encodes every group it generates."""
    arrays = {}
    for name, dtype in _ARRAY_FIELDS.items():
        xs = [getattr(t, name) for t in trajs]
        if any(x.ndim != 1 for x in xs):  # not per-token: one record per trajectory
            rows = [{f.name: getattr(t, f.name) for f in fields(Trajectory)} for t in trajs]
            return msgpack.packb(rows, default=_pack, use_bin_type=True)
        flat = np.concatenate(xs).astype(dtype, copy=False) if xs else np.empty(0, dtype)
        arrays[name] = [[len(x) for x in xs], flat.tobytes()]
    cols = {name: [getattr(t, name) for t in trajs] for name in _SCALAR_FIELDS}
    out = {"n": len(trajs), "cols": cols, "arrays": arrays}
    if any(t.images or t.frames for t in trajs):  # each distinct image once, then keys
        shown = [im for t in trajs for im in [*t.images, *t.frames] if im is not None]
        out["images"] = {im.key: im.png for im in shown}
        out["image_keys"] = [[im.key for im in t.images] for t in trajs]
        out["frame_keys"] = [[im and im.key for im in t.frames] for t in trajs]
    return msgpack.packb(out, default=_pack, use_bin_type=True)  # routed_experts: arrays


def from_bytes(data: bytes) -> list[Trajectory]:
    obj = msgpack.unpackb(data, object_hook=_unpack, raw=False)
    if isinstance(obj, list):  # one record per trajectory
        return [Trajectory(**row) for row in obj]
    n, cols = obj["n"], obj["cols"]
    per: dict[str, list[np.ndarray]] = {}
    for name, dtype in _ARRAY_FIELDS.items():
        lens, raw = obj["arrays"][name]
        flat = np.frombuffer(raw, dtype=dtype).copy()  # writable, owned by this process
        ends = np.cumsum(lens).tolist()
        per[name] = [flat[e - k : e] for e, k in zip(ends, lens)]
    trajs = [
        Trajectory(
            **{name: col[i] for name, col in cols.items()},
            **{name: arrs[i] for name, arrs in per.items()},
        )
        for i in range(n)
    ]
    if "images" in obj:  # one Image object per key, shared by every trajectory showing it
        table = {key: Image(key, png) for key, png in obj["images"].items()}
        for t, keys in zip(trajs, obj["image_keys"], strict=True):
            t.images = [table[key] for key in keys]
        for t, keys in zip(trajs, obj.get("frame_keys", [[]] * n), strict=True):
            t.frames = [key and table[key] for key in keys]
    return trajs


@dataclass
class TrajectoryGroup:
    """All samples of one prompt. What the actor puts into the object store, once."""

    group_id: str
    trajectories: list[Trajectory]

    def __reduce__(self):
        # Ray pickles objects it stores; route through msgpack so arrays go as raw bytes.
        return (_group_from_bytes, (self.group_id, to_bytes(self.trajectories)))


def _group_from_bytes(group_id: str, data: bytes) -> TrajectoryGroup:
    return TrajectoryGroup(group_id, from_bytes(data))
