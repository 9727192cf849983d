"""The vLLM worker extension's reload, at its boundary with vLLM's model runner (a fake
one here; tests/test_weight_sync_vllm.py reloads a real engine)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from asyncrl.engine.worker_ext import INPLACE_LOG, AsyncRLWorkerExtension


class FakeRunner:
    def __init__(self, dtype: torch.dtype):
        self.model_config = SimpleNamespace(dtype=dtype, hf_config=SimpleNamespace())
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def reload_weights(self, weights_iterator):
        self.loaded = list(weights_iterator)

    def get_model(self):
        return SimpleNamespace()


def test_received_tensors_reach_vllm_as_sent_whatever_the_engine_dtype(tmp_path):
    """A bf16 engine gets the learner's fp32 tensors as they are: vLLM casts each to its
    parameter's own dtype (a parameter it keeps in fp32 keeps the full value). The
    object-store path's file load takes the same road."""
    from safetensors.torch import save_file

    sent = [("a.weight", torch.randn(4, 8)), ("steps", torch.arange(3))]
    ext = AsyncRLWorkerExtension()
    ext.model_runner = FakeRunner(torch.bfloat16)
    ext._asyncrl_load(sent)
    assert all(a is b for (_, a), (_, b) in zip(ext.model_runner.loaded, sent))
    save_file(dict(sent), tmp_path / "w.safetensors")
    assert ext.asyncrl_load_file(str(tmp_path / "w.safetensors")) == 2
    got = dict(ext.model_runner.loaded)
    assert got["a.weight"].dtype == torch.float32 and torch.equal(got["a.weight"], sent[0][1])


def test_vllms_per_tensor_narrowing_notice_is_dropped_and_nothing_else(caplog):
    """vLLM's "Attempted to load weight ... into parameter with dtype bfloat16" (once per
    tensor per update on a bf16 engine) is filtered on its logger; its other warnings,
    and the same words from another logger, still show."""
    log = logging.getLogger("vllm.model_executor.models.utils")
    other = logging.getLogger("asyncrl.test_worker_ext")
    notice = "Attempted to load weight %s with dtype %s into parameter with dtype %s"
    with caplog.at_level(logging.WARNING):
        log.warning(notice, "norm.weight", torch.float32, torch.bfloat16)
        log.warning("Failed to load %s", "lm_head.weight")
        other.warning(notice, "norm.weight", torch.float32, torch.bfloat16)
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("vllm.model_executor.models.utils", "Failed to load lm_head.weight"),
        ("asyncrl.test_worker_ext", notice % ("norm.weight", torch.float32, torch.bfloat16)),
    ]


def test_a_sync_nobody_hosts_is_reported_within_the_join_timeout_not_raised():
    """``asyncrl_sync`` answers (a ReceiveReport as a dict, as it crosses vLLM's RPC) even
    when the group never forms: not ok, rank 0 named as the missing peer, nothing loaded,
    within the join timeout."""
    import time

    from asyncrl.transport.group import free_port
    from asyncrl.transport.spec import JoinSpec, ReceiveReport

    ext = AsyncRLWorkerExtension()
    ext.model_runner = FakeRunner(torch.float32)
    spec = JoinSpec("g", "127.0.0.1", free_port(), 1, 2, 1.0, 1.0, "gloo", True)
    t0 = time.monotonic()
    got = ReceiveReport.from_wire(ext.asyncrl_sync(vars(spec)))
    assert time.monotonic() - t0 < 10.0
    assert not got.ok and got.peer_ranks == (0,) and "could not join" in got.error, got
    assert got.rank == 1 and got.bucket is None and ext.model_runner.loaded == []


class LoggingRunner(FakeRunner):
    """Says what vLLM's in-place reload says when a layer got nothing."""

    def __init__(self, model_dir: str):
        super().__init__(torch.float32)
        self.model_config.model = model_dir

    def reload_weights(self, weights_iterator):
        super().reload_weights(weights_iterator)
        logging.getLogger(INPLACE_LOG).warning(
            "Following weights were not loaded from checkpoint: %s", {"x"}
        )


def test_a_lora_payload_is_merged_into_the_base_weights_and_its_notice_dropped(tmp_path, caplog):
    """A payload of adapter tensors (learner.lora, also by the object-store file road)
    reaches vLLM as ``W0 + B @ A`` with ``W0`` from the model directory; vLLM's "not
    loaded" line is dropped around that reload only, kept after a full one."""
    from safetensors.torch import save_file

    w0 = torch.randn(6, 4)
    save_file(
        {"m.proj.weight": w0, "m.other.weight": torch.zeros(2)}, tmp_path / "model.safetensors"
    )
    a, b = torch.randn(2, 4), torch.randn(6, 2)
    save_file({"m.proj.lora_A.weight": a, "m.proj.lora_B.weight": b}, tmp_path / "lora.safetensors")
    ext = AsyncRLWorkerExtension()
    ext.model_runner = LoggingRunner(str(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert ext.asyncrl_load_file(str(tmp_path / "lora.safetensors")) == 2
        (name, w), = ext.model_runner.loaded  # fmt: skip
        assert name == "m.proj.weight"
        torch.testing.assert_close(w, w0 + b @ a, rtol=0, atol=1e-6)
        assert not caplog.records
        ext._asyncrl_load([("m.proj.weight", w0)])
    assert [r.getMessage() for r in caplog.records] == [
        "Following weights were not loaded from checkpoint: {'x'}"
    ]


def test_the_reload_warnings_stay_dropped_after_vllm_sets_up_its_logging_again():
    """The engine core runs vLLM's ``configure_logging`` (a ``dictConfig``) after the
    extension is imported: its "Failed to load weights" warnings stay dropped, and an
    error from the same logger still gets through."""
    from vllm.config import LoggingConfig
    from vllm.logger import configure_logging

    from asyncrl.engine.worker_ext import LAYERWISE_LOG

    configure_logging(LoggingConfig())
    seen: list[str] = []
    catch = logging.Handler()
    catch.emit = lambda record: seen.append(record.getMessage())
    log = logging.getLogger(LAYERWISE_LOG)
    log.addHandler(catch)
    try:
        log.warning("%s: Failed to load weights", "RotaryEmbedding")
        log.error("a real failure")
    finally:
        log.removeHandler(catch)
    assert seen == ["a real failure"]


def test_a_shard_is_copied_in_place_padded_as_a_vocabulary_or_refused_naming_both_shapes():
    """A resharded sync's tensors go straight into the worker's parameters: same shape
    in place; fewer rows of the same width are a vocabulary shard (then zero padding);
    any other shape is one ValueError naming the tensor and both shapes."""
    import pytest

    model = torch.nn.Module()
    model.proj = torch.nn.Linear(8, 4, bias=False)
    model.embed = torch.nn.Embedding(8, 4)
    ext = AsyncRLWorkerExtension()
    ext.model_runner = FakeRunner(torch.float32)
    ext.model_runner.get_model = lambda: model
    w, rows = torch.randn(4, 8), torch.randn(6, 4)
    ext._asyncrl_load_shard([("proj.weight", w), ("embed.weight", rows)])
    assert torch.equal(model.proj.weight, w)
    assert torch.equal(model.embed.weight[:6], rows) and not model.embed.weight[6:].any()
    with pytest.raises(ValueError) as e:
        ext._asyncrl_load_shard([("proj.weight", torch.randn(4, 16))])
    assert str(e.value) == (
        "resharded tensor proj.weight: shard shape (4, 16) does not fit the engine "
        "parameter's (4, 8)"
    )
