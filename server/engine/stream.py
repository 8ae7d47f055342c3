"""What an engine hands back for one request, and the request checks every engine shares.

Free of torch on purpose: the SGLang gateway builds on these in a server process that never
imports torch, and the torch engines (in-process and worker) use the same ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from liveloop.server.engine.types import (
    ContextLengthError,
    InvalidRequestError,
    SamplingParams,
    TokenOutput,
)

MAX_TOP_LOGPROBS = 20


class TokenStream(Protocol):
    """One request's tokens as they come: an async iterator that can be closed early.

    Closing it (`aclose()`), or cancelling the task that reads it, cancels the request.
    """

    def __aiter__(self) -> AsyncIterator[TokenOutput]: ...

    async def __anext__(self) -> TokenOutput: ...

    async def aclose(self) -> None: ...


class RequestStream:
    """The async iterator `generate()` returns: one request's tokens as they are sampled.

    The request is queued when this is created, not when iteration starts (so the decode
    loop can prefill while the caller still sends headers or talks to Redis). Closing it
    (`aclose()`), cancelling the task that reads it, or dropping it unfinished, cancels the
    request (`cancel`, which must be idempotent) and frees its slot.
    """

    def __init__(
        self, queue: asyncio.Queue[TokenOutput | Exception], cancel: Callable[[], None]
    ) -> None:
        self._queue = queue
        self._cancel = cancel
        self._ended = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenOutput:
        if self._ended:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # the consuming task was cancelled
            self.close()
            raise
        if isinstance(item, Exception):
            self._ended = True
            raise item
        if item.finish_reason is not None:
            self._ended = True
        return item

    async def aclose(self) -> None:
        """Stop reading; an unfinished request leaves the engine at once."""
        self.close()

    def close(self) -> None:
        """Synchronous `aclose()`."""
        if not self._ended:
            self._ended = True
            self._cancel()

    def __del__(self) -> None:
        self.close()


def check_request(
    prompt: list[int], params: SamplingParams, vocab_size: int, max_model_len: int
) -> None:
    """Raise ContextLengthError / InvalidRequestError for a request the engine cannot serve."""
    if not prompt:
        raise InvalidRequestError("prompt is empty")
    if len(prompt) + 1 > max_model_len:
        raise ContextLengthError(
            f"prompt has {len(prompt)} tokens; max_model_len {max_model_len} "
            "leaves no room for a completion"
        )
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"token id {bad} outside the vocabulary (0..{vocab_size - 1})")
    if params.max_tokens < 1:
        raise InvalidRequestError("max_tokens must be at least 1")
    if not params.temperature >= 0 or params.temperature == float("inf"):
        raise InvalidRequestError("temperature must be a finite number >= 0")
    if not 0 < params.top_p <= 1:
        raise InvalidRequestError("top_p must be in (0, 1]")
    if not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}")
