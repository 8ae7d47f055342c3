"""Inference engines behind the server, all behind one interface (`EngineClient`).

- `TorchEngine`: the embedded continuous-batching torch engine (`EngineProcess` runs it in
  a worker process);
- `SGLangEngine` (`liveloop.server.engine.sglang`): a gateway to a pool of SGLang servers.

`create_engine` picks one from the settings. The HTTP server and the trainer import only
the names re-exported here. `TorchEngine` is loaded on first use, so importing this
package never imports torch (the SGLang gateway's process must not).
"""

from typing import TYPE_CHECKING, Any

from liveloop.server.engine.base import EngineClient
from liveloop.server.engine.factory import create_engine
from liveloop.server.engine.stream import TokenStream
from liveloop.server.engine.types import (
    ContextLengthError,
    EngineError,
    EngineStats,
    InvalidRequestError,
    SamplingParams,
    TokenConstraint,
    TokenOutput,
    UnknownAdapterError,
    WeightValidationError,
)

if TYPE_CHECKING:
    from liveloop.server.engine.torch_engine import TorchEngine

__all__ = [
    "ContextLengthError",
    "EngineClient",
    "EngineError",
    "EngineStats",
    "InvalidRequestError",
    "SamplingParams",
    "TokenConstraint",
    "TokenOutput",
    "TokenStream",
    "TorchEngine",
    "UnknownAdapterError",
    "WeightValidationError",
    "create_engine",
]


def __getattr__(name: str) -> Any:
    """`TorchEngine` on first use (it imports torch)."""
    if name == "TorchEngine":
        from liveloop.server.engine.torch_engine import TorchEngine

        return TorchEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
