"""model.path as a local directory or a hub id (offline: one line, exit 2, before Ray),
and the learner's architecture check (decoder layers found generically, or refused)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import composed, refused_before_ray
from torch import nn

from asyncrl.config import ConfigError
from asyncrl.models.arch import decoder_layers
from asyncrl.models.resolve import (
    architecture_stamp,
    check_architecture,
    is_hub_id,
    local_or_hub,
)

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_hub_ids_and_paths_are_told_apart(tmp_path):
    assert is_hub_id(HUB_ID) and is_hub_id("Qwen/Qwen2.5-0.5B")
    for path in ("/models/x", "./x/y", "~/x/y", "x", "a/b/c"):
        assert not is_hub_id(path), path
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    assert not is_hub_id(str(tmp_path / "org" / "name"))


def test_a_local_directory_is_checked_as_before(tiny_model, tmp_path):
    assert local_or_hub(str(tiny_model)) == tiny_model
    with pytest.raises(ConfigError, match="no such directory"):
        local_or_hub(str(tmp_path / "nope"))


def test_offline_hub_id_fails_in_the_driver(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty HF cache
    with pytest.raises(ConfigError, match=f"model.path={HUB_ID}: a hub id, but the hub is offline"):
        local_or_hub(HUB_ID)


def test_an_offline_hub_id_ends_the_run_with_one_line_exit_2_before_ray(
    monkeypatch, tmp_path, capsys
):
    """What the CLI runs after composing; tests/test_startup_checks.py holds the command
    line's own part."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty HF cache
    line = refused_before_ray(composed(f"model.path={HUB_ID}"), tmp_path, capsys, monkeypatch)
    assert line == (
        f"asyncrl: config error: model.path={HUB_ID}: a hub id, but the hub is offline "
        "(HF_HUB_OFFLINE=1) and the model is not in the local HF cache; download it where a "
        "hub is reachable, or give a local model directory"
    )


def test_a_cached_hub_id_resolves_offline(monkeypatch, tmp_path, tiny_model):
    """A model in the HF cache (laid out as huggingface_hub writes it) needs no hub."""
    hub = tmp_path / "hf" / "hub" / "models--org--tiny"
    snap = hub / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_model, snap)
    (hub / "refs").mkdir()
    (hub / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    assert local_or_hub("org/tiny") == snap


# ------------------------------------------------------------------ architectures
def test_llama_qwen_style_layers_are_found(tiny_model):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model))
    assert len(decoder_layers(lm)) == 2
    check_architecture(tiny_model, "model.path")


def test_other_layer_names_are_found_generically(tmp_path):
    """GPT-2 keeps its blocks in ``transformer.h``: found through ``_no_split_modules``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=3, n_embd=64, n_head=2, vocab_size=100, n_positions=32)
    with torch.device("meta"):
        lm = GPT2LMHeadModel(config)
    layers = decoder_layers(lm)
    assert len(layers) == 3 and type(layers[0]).__name__ == "GPT2Block"
    (tmp_path / "config.json").write_text(config.to_json_string())
    check_architecture(tmp_path, "model.path")


class _NoBlocks(nn.Module):
    """A causal LM whose blocks the learner cannot name (no ``layers``, no
    ``_no_split_modules``): the FSDP wrapping would have no unit per block."""

    _no_split_modules: list[str] = []

    def __init__(self):
        super().__init__()
        self.config = type("C", (), {"model_type": "oddball"})()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    def get_decoder(self):
        return self


def test_an_architecture_without_findable_layers_is_refused_by_name(tmp_path, monkeypatch):
    with pytest.raises(
        ValueError, match=r"_NoBlocks \(model_type oddball\): cannot find its decoder"
    ):
        decoder_layers(_NoBlocks())
    # the same at start-up, through check_architecture: one ConfigError naming the key
    import transformers

    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path / "cache"))  # no stamp of a pass

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM, "from_config", staticmethod(lambda c: _NoBlocks())
    )
    with pytest.raises(ConfigError, match=r"model.path: .*_NoBlocks .*not supported"):
        check_architecture(tmp_path, "model.path")


def test_an_unknown_model_type_is_refused_at_start(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-arch"}))
    with pytest.raises(ConfigError, match="transformers cannot build it as a causal LM"):
        check_architecture(tmp_path, "model.path")


def test_a_passed_check_is_stamped_and_a_changed_model_is_checked_again(tmp_path, monkeypatch):
    """The stamp of a pass spares the next start the meta build (torch and transformers
    imports); another config.json, transformers version or checking code is another
    stamp, checked anew, and a refusal is never stamped."""
    from asyncrl.models import resolve

    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    built = []
    real = resolve.build_on_meta
    monkeypatch.setattr(resolve, "build_on_meta", lambda d, k: built.append(d) or real(d, k))
    check_architecture(model, "model.path")
    stamp = architecture_stamp(model)
    assert built == [model] and stamp.is_file() and stamp.parent == tmp_path / "cache" / "checked"
    check_architecture(model, "model.path")
    assert built == [model]  # stamped: not built again
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 3}))
    assert architecture_stamp(model) != stamp
    check_architecture(model, "model.path")
    assert built == [model, model]
    monkeypatch.setattr("importlib.metadata.version", lambda name: "0.0-other")
    assert architecture_stamp(model) != stamp
    (model / "config.json").write_text(json.dumps({"model_type": "no-such-arch"}))
    with pytest.raises(ConfigError):
        check_architecture(model, "model.path")
    assert not architecture_stamp(model).exists()
