"""The vLLM worker extension's reload, at its boundary with vLLM's model runner (a fake
one here; tests/test_weight_sync_vllm.py reloads a real engine)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from asyncrl.actor.worker_ext import AsyncRLWorkerExtension


class FakeRunner:
    def __init__(self, dtype: torch.dtype):
        self.model_config = SimpleNamespace(dtype=dtype, hf_config=SimpleNamespace())
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def reload_weights(self, weights_iterator):
        self.loaded = list(weights_iterator)

    def get_model(self):
        return SimpleNamespace()


def test_fp32_weights_reach_a_bf16_engine_as_bf16_and_an_fp32_one_unchanged(tmp_path):
    """The learner sends fp32; an engine at actor.engine.dtype=bfloat16 gets them cast
    once, before vLLM's loader (which would cast each itself and warn per tensor, per
    update), with the values rounded as a cast rounds them; integer tensors pass as they
    are; an fp32 engine gets the very tensors it was sent. The object-store path's file
    load takes the same road."""
    from safetensors.torch import save_file

    w = torch.randn(4, 8)
    sent = [("a.weight", w), ("steps", torch.arange(3))]
    for dtype in (torch.bfloat16, torch.float32):
        ext = AsyncRLWorkerExtension()
        ext.model_runner = FakeRunner(dtype)
        ext._asyncrl_load(sent)
        (_, a), (_, steps) = ext.model_runner.loaded
        assert a.dtype == dtype and torch.equal(a, w.to(dtype))
        assert steps.dtype == torch.int64 and torch.equal(steps, torch.arange(3))
        if dtype == torch.float32:
            assert a is w  # no copy at the engine's own dtype
    save_file(dict(sent), tmp_path / "w.safetensors")
    ext = AsyncRLWorkerExtension()
    ext.model_runner = FakeRunner(torch.bfloat16)
    assert ext.asyncrl_load_file(str(tmp_path / "w.safetensors")) == 2
    assert {n: t.dtype for n, t in ext.model_runner.loaded} == {
        "a.weight": torch.bfloat16, "steps": torch.int64}  # fmt: skip
