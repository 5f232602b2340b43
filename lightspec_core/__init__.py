"""LightSpec engine: continuous batching with dynamic multi-token-prediction speculative decoding.

>>> from lightspec_core import LLMEngine, EngineConfig, SamplingParams
>>> engine = LLMEngine(EngineConfig(speculation="mtp", policy="dynamic"))
>>> out = engine.generate(["def fib(n):"], SamplingParams(max_tokens=32))[0]
"""

from __future__ import annotations

import importlib

from .config import EngineConfig, SamplingParams, SpecMethod, default_model_dir

# The engine pulls in torch (about a second to import); configuration and validation do not need it,
# so ``lightspec serve`` can check every parameter before it starts a server.
_LAZY = {
    "LLMEngine": ".engine.engine",
    "RequestDelta": ".engine.outputs",
    "RequestOutput": ".engine.outputs",
}

__all__ = [
    "EngineConfig",
    "LLMEngine",
    "RequestDelta",
    "RequestOutput",
    "SamplingParams",
    "SpecMethod",
    "default_model_dir",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
