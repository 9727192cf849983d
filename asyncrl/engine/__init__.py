"""Inference engines for the actor, the judge and eval: building and driving vLLM
(``vllm_engine.py``), its plugin (``vllm_plugin.py``) and the worker extension that
receives weights in place (``worker_ext.py``); SGLang's offline Engine
(``sglang_engine.py``); ``backend.py`` picks one. The only package that imports an
engine library."""
