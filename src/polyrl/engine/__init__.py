"""The embedded generation engine: continuous batching over a paged KV cache."""

from polyrl.engine.engine import Engine
from polyrl.engine.types import EngineRequest, EngineSampling, SampleDelta, SampleResult

__all__ = ["Engine", "EngineRequest", "EngineSampling", "SampleDelta", "SampleResult"]
