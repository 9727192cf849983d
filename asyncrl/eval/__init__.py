"""Periodic held-out evaluation beside training: settings.py (the
``eval.*`` keys), split.py (the held-out split of a task), actor.py (the Ray actor with
its own vLLM engine), driver.py (what the training loop calls each step)."""

from asyncrl.eval.settings import EvalSetSettings, EvalSettings

__all__ = ["EvalSetSettings", "EvalSettings"]
