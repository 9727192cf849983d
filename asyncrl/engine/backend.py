"""Which class a run's engines are: ``actor.engine.backend`` (``EngineBackend``) picks
vLLM's (vllm_engine.py) or SGLang's (sglang_engine.py). The rollout actor, the judge's
server and the evaluator start their engines here; neither library is imported until an
engine starts."""

from __future__ import annotations

from asyncrl.engine.protocol import Engine
from asyncrl.engine.settings import EngineBackend, EngineSettings


def make_engine(
    model_path: str, s: EngineSettings, seed: int = 0, record_experts: bool = False
) -> Engine:
    """Start an engine of ``s.backend`` on ``model_path`` (``record_experts``: vLLM's
    only; a run asking for it with SGLang is refused before Ray starts)."""
    if s.backend == EngineBackend.SGLANG:
        from asyncrl.engine import sglang_engine

        return sglang_engine.make_engine(model_path, s, seed)
    from asyncrl.engine import vllm_engine

    return vllm_engine.make_engine(model_path, s, seed, record_experts)


def warm_engine_start(s: EngineSettings) -> None:
    """vLLM's fork server, forked first thing in a Ray actor's process
    (``vllm_engine.warm_engine_start``); SGLang starts its own processes."""
    if s.backend == EngineBackend.VLLM:
        from asyncrl.engine import vllm_engine

        vllm_engine.warm_engine_start(s)
