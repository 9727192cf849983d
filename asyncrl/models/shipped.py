"""The default tiny model ships with asyncrl (``asyncrl/models/tiny_default/``, 1.6 MB).

Built on each machine, the warm start's floating-point path follows the CPU (torch
picks AVX2 or AVX-512 kernels at run time, and the sums round differently), so another
machine got another model and other figures. The default (spec, task) is therefore
copied from the package, never built; its weights' sha256 is recorded here and checked
on every copy. Any other spec or task is still built on the machine
(docs/reproducibility.md).

To regenerate after a deliberate change of the default spec or task:
``python -m asyncrl.models.tiny --rebuild DIR``, copy DIR's files here, and update
:data:`WEIGHTS_SHA256` and :data:`CACHE_KEY` (the test suite names both values).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from asyncrl.utils.fingerprint import file_sha256

SHIPPED_DIR = Path(__file__).resolve().with_name("tiny_default")
# sha256 of tiny_default/model.safetensors: default_spec() on AdditionTask(max_operand=19),
# built 2026-12-01 (torch 2.13.0+cpu, AVX2); 1 and 2 threads built the same bytes.
WEIGHTS_SHA256 = "5e17827b5cf57fb3f8449759f3df206c85d4cc73996c9f193fc90688f80a661e"
# asyncrl.models.tiny.cache_key(AdditionTask(max_operand=19), default_spec())
CACHE_KEY = "f3dcfb3a5b17"
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "asyncrl_build.json",
)


class ShippedModelError(RuntimeError):
    """The packaged files are missing or their weights are not the recorded ones."""


def is_current(model_dir: Path) -> bool:
    """``model_dir`` holds the shipped default model (its weights' sha256 is the recorded one)."""
    weights = model_dir / "model.safetensors"
    return (
        (model_dir / "config.json").exists()
        and weights.exists()
        and (file_sha256(weights) == WEIGHTS_SHA256)
    )


def install(out: Path) -> Path:
    """Copy the shipped files to ``out`` atomically (a reader never sees half a model);
    an older model there (built on this machine before the model shipped) is replaced."""
    if not is_current(SHIPPED_DIR):
        raise ShippedModelError(
            f"{SHIPPED_DIR}: the packaged tiny model is missing or its weights' sha256 is not "
            f"{WEIGHTS_SHA256}; reinstall asyncrl"
        )
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in FILES:
        shutil.copyfile(SHIPPED_DIR / name, tmp / name)
    if not is_current(tmp):
        raise ShippedModelError(f"{tmp}: the copied weights' sha256 is not {WEIGHTS_SHA256}")
    if out.exists():
        old = out.with_name(f"{out.name}.old{os.getpid()}")
        os.replace(out, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, out)
    return out
