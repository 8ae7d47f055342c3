"""Inference engines behind the server: the embedded continuous-batching torch engine.

The HTTP server and the trainer import only the names re-exported here.
"""

from liveloop.server.engine.torch_engine import TorchEngine
from liveloop.server.engine.types import (
    ContextLengthError,
    EngineError,
    EngineStats,
    InvalidRequestError,
    SamplingParams,
    TokenConstraint,
    TokenOutput,
    WeightValidationError,
)

__all__ = [
    "ContextLengthError",
    "EngineError",
    "EngineStats",
    "InvalidRequestError",
    "SamplingParams",
    "TokenConstraint",
    "TokenOutput",
    "TorchEngine",
    "WeightValidationError",
]
