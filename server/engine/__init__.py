"""Inference engines behind the server: the embedded continuous-batching torch engine.

The HTTP server and the trainer import only the names re-exported here.
"""

from server.engine.torch_engine import TorchEngine
from server.engine.types import (
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
