"""The default tiny model ships with asyncrl (``asyncrl/models/tiny_default/``, 1.6 MB),
and so does the default tiny vision-language model (``asyncrl/models/tiny_vlm_default/``,
2 MB).

Built on each machine, a warm start's floating-point path follows the CPU (torch picks
AVX2 or AVX-512 kernels at run time, and the sums round differently), so another machine
got another model and other figures. The default (spec, task) of each is therefore
copied from the package, never built; its weights' sha256 is recorded here and checked
on every copy. Any other spec or task is still built on the machine
(docs/reproducibility.md).

To regenerate after a deliberate change of a default spec or task:
``python -m asyncrl.models.tiny --rebuild DIR`` (or ``asyncrl.models.tiny_vlm``), copy
DIR's files into the package, and update the model's recorded sha256 and cache key here
(the test suite names both values).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from asyncrl.utils.fingerprint import file_sha256

PACKAGE_DIR = Path(__file__).resolve().parent


class ShippedModelError(RuntimeError):
    """The packaged files are missing or their weights are not the recorded ones."""


@dataclass(frozen=True)
class ShippedModel:
    """One model directory in the package: its files, its weights' recorded sha256, and
    the cache key its (spec, task) has, under which it is installed."""

    dir: Path
    weights_sha256: str
    cache_key: str
    files: tuple[str, ...]

    def is_current(self, model_dir: Path | str) -> bool:
        """``model_dir`` holds this model (its weights' sha256 is the recorded one)."""
        weights = Path(model_dir) / "model.safetensors"
        return (
            (Path(model_dir) / "config.json").exists()
            and weights.exists()
            and (file_sha256(weights) == self.weights_sha256)
        )

    def install(self, out: Path) -> Path:
        """Copy the shipped files to ``out`` atomically (a reader never sees half a
        model); an older model there (built on this machine before the model shipped)
        is replaced."""
        if not self.is_current(self.dir):
            raise ShippedModelError(
                f"{self.dir}: the packaged model is missing or its weights' sha256 is not "
                f"{self.weights_sha256}; reinstall asyncrl"
            )
        tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name in self.files:
            shutil.copyfile(self.dir / name, tmp / name)
        if not self.is_current(tmp):
            raise ShippedModelError(
                f"{tmp}: the copied weights' sha256 is not {self.weights_sha256}"
            )
        if out.exists():
            old = out.with_name(f"{out.name}.old{os.getpid()}")
            os.replace(out, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, out)
        return out


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
TINY = ShippedModel(PACKAGE_DIR / "tiny_default", WEIGHTS_SHA256, CACHE_KEY, FILES)
SHIPPED_DIR = TINY.dir

# model=tiny_vlm on task=visual_addition at their defaults, built 2026-12-06 (torch
# 2.13.0+cpu, AMD EPYC, 2 threads; asyncrl.models.tiny_vlm:
# cache_key(default_task(), TinyVLMSpec.defaults(), default_lm_spec()))
TINY_VLM = ShippedModel(
    PACKAGE_DIR / "tiny_vlm_default",
    weights_sha256="6e2fe05f0018df4e2342cd20ad3706e734c185506a0eaa33105cefc9d5262313",
    cache_key="662d4f11043c",
    files=(*FILES, "processor_config.json"),
)


def is_current(model_dir: Path) -> bool:
    """``model_dir`` holds the shipped default tiny model."""
    return TINY.is_current(model_dir)


def install(out: Path) -> Path:
    """Install the shipped default tiny model at ``out`` (:meth:`ShippedModel.install`)."""
    return TINY.install(out)
