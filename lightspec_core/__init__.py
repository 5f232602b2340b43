"""LightSpec engine: continuous batching with dynamic multi-token-prediction speculative decoding.

>>> from lightspec_core import LLMEngine, EngineConfig, SamplingParams
>>> engine = LLMEngine(EngineConfig(speculation="mtp", policy="dynamic"))
>>> out = engine.generate(["def fib(n):"], SamplingParams(max_tokens=32))[0]
"""

from .config import EngineConfig, SamplingParams, SpecMethod
from .engine.engine import LLMEngine, default_model_dir
from .engine.outputs import RequestDelta, RequestOutput

__all__ = [
    "EngineConfig",
    "LLMEngine",
    "RequestDelta",
    "RequestOutput",
    "SamplingParams",
    "SpecMethod",
    "default_model_dir",
]
