"""State shared between a request's consumer (its event loop) and the decode thread.

Kept apart from the engine so that `torch_engine.py` reads as the decode loop itself: these
are the plain records the two sides exchange and the small helpers that hand results
across threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from server.engine.types import SamplingParams, TokenOutput


@dataclass(eq=False)
class Request:
    """A request's state, shared by its consumer (event loop) and the decode thread."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[TokenOutput | Exception]
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    max_new: int
    output: list[int] = field(default_factory=list)
    cancelled: bool = False
    done: bool = False
    kv_epoch: int = -1  # the engine's swap count when this request's prefill began


@dataclass(eq=False)
class Swap:
    """A validated state dict waiting to be applied between two decode steps."""

    state_dict: Mapping[str, torch.Tensor]
    version: int
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
