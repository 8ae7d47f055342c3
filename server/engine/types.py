"""Data types shared by the engines and their callers (HTTP server, trainer, tests).

They are kept free of engine internals so that the server can be written against them
whichever engine (embedded torch, SGLang gateway) produces the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from liveloop.server.tools.spec import OutputSpec


@runtime_checkable
class TokenConstraint(Protocol):
    """The torch engine's grammar hook: which tokens may be sampled next.

    Callers describe structured output with `SamplingParams.grammar` (plain data every
    engine understands); the torch engine compiles that into one of these (xgrammar). It
    only asks for the mask before sampling, reports the sampled token, and finishes the
    request with "stop" once it terminates. Setting `SamplingParams.constraint` directly
    is for code that drives an in-process `TorchEngine` itself (tests, benchmarks).
    """

    def allowed_token_mask(self, vocab_size: int) -> torch.Tensor | None:
        """Bool tensor [vocab_size] (True = allowed), or None for no restriction."""
        ...

    def accept_token(self, token_id: int) -> None:
        """Advance the grammar by the token the engine sampled."""
        ...

    def is_terminated(self) -> bool:
        """True once the grammar is complete; the request then ends with "stop"."""
        ...


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops.

    `grammar` is what constrained decoding must produce (forced tool calls or JSON), as a
    serializable description; each engine turns it into its own mechanism (the torch
    engine compiles it with xgrammar, the SGLang gateway sends it in SGLang's
    `sampling_params`). `constraint` is the torch engine's compiled per-request state.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    top_logprobs: int = 0
    grammar: OutputSpec | None = None
    constraint: TokenConstraint | None = None
    ignore_eos: bool = False


@dataclass
class TokenOutput:
    """One generated token with the data training needs (behaviour log-prob, version)."""

    token_id: int
    logprob: float
    version: int
    top_logprobs: list[tuple[int, float]]
    finish_reason: str | None = None
    stop_string: str | None = None
    # On a request's last token only, from engines that learn the versions late (SGLang's
    # weight_versions spans): the version of every completion token, replacing the
    # provisional `version`s reported token by token.
    versions: list[int] | None = None


@dataclass
class EngineStats:
    """Cumulative counters of an engine's decode loop, for /metrics and benchmarks."""

    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0  # forward + sampling of the decode steps
    weight_swaps: int = 0
    swap_pause_seconds: float = 0.0
    busy_cpu_seconds: float = 0.0  # CPU time of the decode thread itself while it had work
    prefix_hit_tokens: int = 0  # prompt tokens whose keys/values came from the prefix cache


class EngineError(RuntimeError):
    """The engine cannot serve a request (stopped, internal failure, bad input)."""


class InvalidRequestError(EngineError, ValueError):
    """Bad request parameters (empty prompt, token id out of range, top_logprobs > 20...)."""


class WeightValidationError(EngineError):
    """A state dict offered to swap_weights is unusable; the message names the problem."""


class UnknownAdapterError(InvalidRequestError):
    """A request names an adapter the engine does not serve (never loaded, or unloaded)."""


class ContextLengthError(EngineError):
    """The prompt does not fit the engine's max_model_len."""
