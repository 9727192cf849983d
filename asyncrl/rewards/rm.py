"""A sequence-classification reward model served on a Ray actor (``reward=rm``).

::

    reward worker 1 ─ RewardModel.score(batch) ─┐
    reward worker 2 ─ RewardModel.score(batch) ─┤  texts (prompt + response)
                                                ▼
                        RewardModelServer (one named Ray actor per model+settings)
                          DynamicBatcher: waits for max_batch texts or max_wait_ms
                          one forward pass (torch, in a thread) ─▶ one float each

Any local Hugging Face directory whose config names a ``*ForSequenceClassification``
architecture with one label, or ``tiny`` (:func:`asyncrl.rewards.tiny_rm.ensure_tiny_rm`).
fp32 on a CPU; on a GPU when ``num_gpus`` > 0 and one is there. The directory is checked
when the component is built (in the driver, before Ray starts); the actor starts on the
first call, so building the component costs nothing else.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from asyncrl.config import ConfigError
from asyncrl.rewards.base import Reward, RewardInput, RewardOutput
from asyncrl.rewards.serving import DynamicBatcher, actor_name, kill_actor, shared_actor

DTYPES = ("float32", "bfloat16", "float16")


def check_rm_dir(path: str) -> Path:
    """A usable local sequence-classification directory, or a ConfigError naming ``model``."""
    p = Path(path).expanduser()
    where = f"model={path}"
    if not p.is_dir():
        raise ConfigError(f"{where}: no such directory")
    try:
        conf = json.loads((p / "config.json").read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where}: no config.json (not a Hugging Face model directory)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: config.json is not valid JSON ({e})") from e
    archs = conf.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ConfigError(
            f"{where}: architectures {archs} has no *ForSequenceClassification "
            "(a reward model is a sequence classifier with one label)"
        )
    labels = len(conf.get("id2label") or {}) or conf.get("num_labels", 2)
    if labels != 1:
        raise ConfigError(f"{where}: {labels} labels; a reward model has exactly one")
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise ConfigError(f"{where}: no weights (*.safetensors or *.bin)")
    if not (p / "tokenizer.json").is_file() and not (p / "tokenizer_config.json").is_file():
        raise ConfigError(f"{where}: no tokenizer (tokenizer.json / tokenizer_config.json)")
    return p


class RewardModelServer:
    """The Ray actor holding the model (async: requests coalesce while a pass runs)."""

    def __init__(
        self, model_dir: str, max_batch: int, max_wait_ms: float, dtype: str, threads: int
    ):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        torch.set_num_threads(threads)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        if self.tok.pad_token is None:  # many RMs ship without one; batching needs it
            self.tok.pad_token = self.tok.eos_token
        self.tok.truncation_side = "left"  # keep the response, the part being scored
        self.model = AutoModelForSequenceClassification.from_pretrained(
            model_dir, dtype=getattr(torch, dtype)
        ).to(self.device)
        self.model.eval()
        self.model.config.pad_token_id = self.tok.pad_token_id
        self.max_len = getattr(self.model.config, "max_position_embeddings", None)
        self.batcher = DynamicBatcher(self._run, max_batch, max_wait_ms)

    async def score(self, texts: list[str]) -> list[float]:
        return await self.batcher.submit(texts)

    async def _run(self, texts: list[str]) -> list[float]:
        return await asyncio.to_thread(self.forward, texts)

    def forward(self, texts: list[str]) -> list[float]:
        import torch

        enc = self.tok(
            texts,
            padding=True,
            truncation=self.max_len is not None,
            max_length=self.max_len,
            return_tensors="pt",
            add_special_tokens=False,
        ).to(self.device)
        with torch.no_grad():
            return self.model(**enc).logits[:, 0].float().tolist()

    def stats(self) -> dict[str, Any]:
        return {**self.batcher.stats(), "device": self.device}


class RewardModel(Reward):
    """``reward.components`` entry: ``{_target_: asyncrl.rewards.rm.RewardModel, model: tiny}``.

    The score is the model's single logit on ``prompt + response`` (times ``scale``).
    """

    name = "rm"  # the default metric name (reward/rm); the start-up check reads it

    def __init__(
        self,
        model: str = "tiny",
        name: str = "rm",
        max_batch: int = 64,
        max_wait_ms: float = 20.0,
        num_gpus: float = 0.0,
        num_cpus: float = 0.0,
        dtype: str = "float32",
        scale: float = 1.0,
        timeout_s: float = 60.0,
    ):
        if max_batch < 1:
            raise ConfigError(f"max_batch={max_batch}: expected an integer >= 1")
        if max_wait_ms < 0 or timeout_s <= 0:
            raise ConfigError(
                f"max_wait_ms={max_wait_ms}, timeout_s={timeout_s}: expected >= 0, > 0"
            )
        if dtype not in DTYPES:
            raise ConfigError(f"dtype={dtype!r}: expected one of {DTYPES}")
        if model == "tiny":
            from asyncrl.rewards.tiny_rm import ensure_tiny_rm

            self.model_dir = str(ensure_tiny_rm())
        else:
            self.model_dir = str(check_rm_dir(model))
        self.name, self.max_batch, self.timeout_s, self.scale = name, max_batch, timeout_s, scale
        self.max_wait_ms, self.num_gpus, self.num_cpus, self.dtype = (
            max_wait_ms,
            num_gpus,
            num_cpus,
            dtype,
        )
        self._server: Any = None

    @staticmethod
    def check_config(kwargs: dict[str, Any]) -> None:
        """In the driver, before Ray starts (RewardSettings.check): the model directory."""
        if kwargs.get("model", "tiny") != "tiny":
            check_rm_dir(str(kwargs["model"]))

    def _settings(self) -> dict[str, Any]:
        return {
            k: getattr(self, k)
            for k in ("model_dir", "max_batch", "max_wait_ms", "dtype", "num_gpus")
        }

    def server(self) -> Any:
        """The served model's actor handle (started by the first caller of any worker)."""
        if self._server is None:
            options = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
            args = (
                self.model_dir,
                self.max_batch,
                self.max_wait_ms,
                self.dtype,
                max(1, int(self.num_cpus)),
            )
            self._server = shared_actor(
                RewardModelServer, actor_name("rm", self._settings()), options, *args
            )
        return self._server

    async def score(self, batch: list[RewardInput]) -> list[RewardOutput]:
        values = await self.server().score.remote([x.prompt + x.response for x in batch])
        return [RewardOutput(value=self.scale * v) for v in values]

    async def close(self) -> None:
        if self._server is not None:
            kill_actor(self._server)
            self._server = None
