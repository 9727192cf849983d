"""A model directory (``model.path``, asyncrl.config.check_model_dir, also through
asyncrl.models.resolve.local_or_hub) is checked before Ray starts: a malformed
config.json or a weights file that is empty, unreadable or truncated is one ConfigError
line naming the key, never a traceback."""

from __future__ import annotations

import json
import struct

import pytest

from asyncrl.config import ConfigError, check_model_dir
from asyncrl.models.resolve import local_or_hub

GOOD_CONFIG = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 2}


def safetensors(header: dict) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h


def model_dir(tmp_path, config: bytes | None = None, weights: bytes | None = None):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_bytes(json.dumps(GOOD_CONFIG).encode() if config is None else config)
    (d / "model.safetensors").write_bytes(safetensors({}) if weights is None else weights)
    (d / "tokenizer.json").write_text("{}")
    return d


CONFIGS = {
    "not UTF-8": (
        b'{"model_type": "qwen\xff"}',
        "config.json is not valid JSON (UnicodeDecodeError: ",
    ),
    "not JSON": (b"{model_type: qwen2}", "config.json is not valid JSON (JSONDecodeError: "),
    "empty": (b"", "config.json is not valid JSON (JSONDecodeError: Expecting value"),
    "nested too deeply": (b"[" * 100_000, "config.json is not valid JSON (RecursionError: "),
    "a number": (b"3", "config.json is not a JSON object: 3"),
    "a list": (b'["model_type"]', 'config.json is not a JSON object: ["model_type"]'),
    "no model_type": (b'{"model_type": null}', "config.json has no model_type"),
    "text heads": (
        b'{"model_type": "qwen2", "num_attention_heads": "2", "hidden_size": 64}',
        "config.json num_attention_heads='2': expected a positive integer",
    ),
    "zero hidden size": (
        b'{"model_type": "qwen2", "num_attention_heads": 2, "hidden_size": 0}',
        "config.json hidden_size=0: expected a positive integer",
    ),
    "text head_dim": (
        b'{"model_type": "qwen2", "head_dim": "wide"}',
        "config.json head_dim='wide': expected a positive integer",
    ),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_a_malformed_config_json_is_one_line_naming_the_key(tmp_path, case):
    data, want = CONFIGS[case]
    d = model_dir(tmp_path, config=data)
    with pytest.raises(ConfigError) as e:
        local_or_hub(str(d))
    msg = str(e.value)
    assert msg.startswith(f"model.path={d}: {want}"), msg
    assert "\n" not in msg and len(msg) < 400


def test_weights_that_are_empty_unreadable_or_truncated_are_refused(tmp_path):
    d = model_dir(tmp_path, weights=b"")
    with pytest.raises(
        ConfigError, match=r": weights file model.safetensors is empty \(0 bytes\)$"
    ):
        check_model_dir(str(d))
    # a shard that is not there (a dangling link, as a half-copied HF cache leaves it)
    (d / "model.safetensors").write_bytes(safetensors({}))
    (d / "model-2.safetensors").symlink_to(tmp_path / "gone")
    with pytest.raises(ConfigError, match=r": weights file model-2.safetensors cannot be read \("):
        check_model_dir(str(d))
    (d / "model-2.safetensors").unlink()
    (d / "model-2.safetensors").mkdir()  # a directory where a weights file should be
    with pytest.raises(ConfigError, match=r": weights file model-2.safetensors cannot be read \("):
        check_model_dir(str(d))
    (d / "model-2.safetensors").rmdir()
    cut = safetensors({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})[:20]
    (d / "model.safetensors").write_bytes(cut)
    with pytest.raises(
        ConfigError, match=r": weights file model.safetensors is truncated \(20 bytes"
    ):
        check_model_dir(str(d))
    (d / "model.safetensors").write_bytes(b"\x00\x01")
    with pytest.raises(ConfigError, match=r"model.safetensors is truncated \(2 bytes"):
        check_model_dir(str(d))
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"")  # the *.bin fallback is checked the same way
    with pytest.raises(ConfigError, match=r": weights file pytorch_model.bin is empty"):
        check_model_dir(str(d))


def test_a_well_formed_directory_passes(tmp_path):
    d = model_dir(tmp_path)
    assert check_model_dir(str(d)) == d
    (d / "config.json").write_text(json.dumps({**GOOD_CONFIG, "head_dim": None}))
    assert check_model_dir(str(d)) == d  # a null head_dim: derived from the sizes
