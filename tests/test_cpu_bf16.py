"""A run that computes in bf16 on a CPU without native bf16 (no AVX512-BF16, no AMX) is
told so in one line before anything is built: there it runs about 100x slower than fp32."""

from __future__ import annotations

import logging

from asyncrl.utils.cpu import cpu_flags, native_bf16, slow_bf16_warning
from asyncrl.wiring import cpu_bf16_keys
from tests.helpers import composed as compose

AVX2 = {"fpu", "sse2", "avx", "avx2", "fma"}


def test_cpu_flags_are_the_first_processors(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\n\nprocessor\t: 1\nflags\t: fpu\n")
    assert cpu_flags(f) == {"fpu", "avx2", "amx_bf16"}
    assert cpu_flags(tmp_path / "none") is None
    (tmp_path / "bare").write_text("processor\t: 0\n")
    assert cpu_flags(tmp_path / "bare") is None


def test_native_bf16_needs_avx512_bf16_or_amx():
    assert not native_bf16(AVX2)
    assert native_bf16(AVX2 | {"avx512f", "avx512_bf16"})
    assert native_bf16(AVX2 | {"amx_tile", "amx_bf16"})
    assert not native_bf16(AVX2 | {"avx512f"})  # AVX-512 without its bf16 extension


def test_the_warning_names_the_keys_only_where_bf16_is_slow():
    keys = ["learner.autocast", "actor.engine.dtype"]
    line = slow_bf16_warning(keys, AVX2)
    assert line is not None and "\n" not in line
    assert line.startswith("learner.autocast, actor.engine.dtype: bf16 on this CPU")
    assert slow_bf16_warning(keys, AVX2 | {"amx_bf16"}) is None
    assert slow_bf16_warning([], AVX2) is None


def test_the_keys_are_the_bf16_settings_a_cpu_would_run():
    assert cpu_bf16_keys(compose()) == []
    small = ["model.tiny.warm_start_bf16", "learner.autocast", "actor.engine.dtype"]
    assert cpu_bf16_keys(compose("model=small")) == small
    # ranks and actors given a GPU compute there; the warm start is built on this CPU
    gpus = compose("model=small", "learner.num_gpus=1", "actor.num_gpus=1")
    assert cpu_bf16_keys(gpus) == ["model.tiny.warm_start_bf16"]
    assert cpu_bf16_keys(compose("model=small", "model.path=/some/model"))[0] == "learner.autocast"


def test_prepare_warns_before_the_model_is_resolved(monkeypatch, caplog):
    import asyncrl.wiring as wiring

    class Resolved(Exception):
        pass

    def resolve(cfg, task):
        raise Resolved

    monkeypatch.setattr(wiring, "resolve_model", resolve)
    monkeypatch.setattr(wiring, "slow_bf16_warning", lambda keys: slow_bf16_warning(keys, AVX2))
    with caplog.at_level(logging.WARNING, logger="asyncrl.wiring"):
        try:
            wiring.prepare(compose("model=small"))
        except Resolved:
            pass
    lines = [r.getMessage() for r in caplog.records if "bf16 on this CPU" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("model.tiny.warm_start_bf16, learner.autocast")
