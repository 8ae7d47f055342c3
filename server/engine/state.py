"""Requests as the engine holds them: validation, and the state shared across threads.

Kept apart from the engine so that `torch_engine.py` reads as the decode loop itself: these
are the plain records the two sides exchange and the small helpers that hand results
across threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from liveloop.server.engine.sampling import find_stop_string
from liveloop.server.engine.types import SamplingParams, TokenOutput

if TYPE_CHECKING:
    from liveloop.server.engine.adapters import Adapter


@dataclass(eq=False)
class Request:
    """A request's state, shared by its consumer (event loop) and the decode thread."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop | None  # None: results go to the engine's output sink
    queue: asyncio.Queue[TokenOutput | Exception] | None
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    max_new: int
    output: list[int] = field(default_factory=list)
    cancelled: bool = False
    done: bool = False
    kv_epoch: int = -1  # the engine's swap count when this request's prefill began
    adapter: str | None = None  # the LoRA adapter it asked for (None: the base model)
    lora: Adapter | None = None  # that adapter, pinned from prefill start to the end
    kv_key: Hashable = None  # prefix-cache namespace of the weights its prefill began on
    arrived: float = 0.0  # time.monotonic() when queued
    adapter_wait_since: float = 0.0  # when it began to wait for its adapter to be read back


@dataclass(eq=False)
class BetweenSteps:
    """A change of weights (a validated state dict, an adapter) to apply between two
    decode steps; `apply` returns the pause it caused (s)."""

    apply: Callable[[], float]
    what: str
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[float]


def put_all(
    items: list[tuple[asyncio.Queue[TokenOutput | Exception], TokenOutput | Exception]],
) -> None:
    """Runs on a consumer's event loop: enqueue a batch of results."""
    for queue, item in items:
        queue.put_nowait(item)


def settle(future: asyncio.Future[float], value: float | Exception) -> None:
    """Runs on the swapper's event loop: resolve its future unless it was cancelled."""
    if future.done():
        return
    if isinstance(value, Exception):
        future.set_exception(value)
    else:
        future.set_result(value)


def eos_ids(model: nn.Module, tokenizer: Any) -> frozenset[int]:
    """End-of-sequence ids from the tokenizer and the model's generation config."""
    found: set[int] = set()
    gen_config = getattr(model, "generation_config", None)
    for value in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(gen_config, "eos_token_id", None),
    ):
        if isinstance(value, int):
            found.add(value)
        elif isinstance(value, list | tuple):
            found.update(int(v) for v in value)
    return frozenset(found)


def default_max_len(model: nn.Module) -> int:
    """The model's context length (capped by a sliding window, which we do not implement)."""
    config: Any = getattr(model, "config", None)
    limit = int(getattr(config, "max_position_embeddings", None) or 2048)
    window = getattr(config, "sliding_window", None)
    if isinstance(window, int) and window > 0 and getattr(config, "use_sliding_window", True):
        limit = min(limit, window)  # within the window, full attention is exact
    return limit


def finish_reason(req: Request, token: int, tokenizer: Any) -> tuple[str | None, str | None]:
    """("stop" | "length" | None, the stop string that matched) after `token`."""
    params = req.params
    if token in req.stop_ids:
        return "stop", None
    if params.constraint is not None and params.constraint.is_terminated():
        return "stop", None
    if params.stop:
        matched = find_stop_string(tokenizer, req.output, params.stop)
        if matched is not None:
            return "stop", matched
    if len(req.output) >= req.max_new:
        return "length", None
    return None, None


OutputSink = Callable[[list[tuple[str, TokenOutput | Exception]]], None]


def deliver(
    items: list[tuple[Request, TokenOutput | Exception]], sink: OutputSink | None = None
) -> None:
    """Hand items to their consumers: one callback per event loop, one sink call for the rest."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Any]] = {}
    to_sink: list[tuple[str, TokenOutput | Exception]] = []
    for req, item in items:
        if req.loop is None:
            to_sink.append((req.request_id, item))
        else:
            by_loop.setdefault(req.loop, []).append((req.queue, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(put_all, batch)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            for req, _ in items:
                if req.loop is loop:
                    req.cancelled = True
    if to_sink and sink is not None:
        sink(to_sink)
