"""The embedded generation engine: continuous batching over a paged KV cache.

`Engine` is imported on first use: the request types are light, and processes that only
speak the engine's vocabulary (the manager) should not pay for importing torch."""

from typing import Any

from polyrl.engine.types import EngineRequest, SampleDelta, SampleResult
from polyrl.protocol.sampling import SamplingParams

__all__ = ["Engine", "EngineRequest", "SamplingParams", "SampleDelta", "SampleResult"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from polyrl.engine.engine import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
