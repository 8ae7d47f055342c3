"""The embedded continuous-batching engine: PyTorch + transformers inside the server process.

Why it exists: `liveloop up` must serve (and hot-swap) a model with no external inference
server. A dedicated decode thread owns the model and a batched KV cache; each iteration it
applies pending weight swaps and adapter changes, drops finished or cancelled requests,
prefills the oldest waiting request that can start (in chunks of `prefill_chunk_tokens`,
after seeding it from the prefix cache) and, once prefilled, lets it join the batch (up to
`max_batch_size` running), then runs one decode step for the whole batch. Tokens go back
to each request's asyncio queue on its own event loop, so the event loop never waits on
torch.

A request may name a LoRA adapter (`generate(..., adapter=NAME)`): each row of a decode
step applies its own adapter (`lora.py`; which adapters are in memory: `adapters.py`), so
requests on different adapters share every step. A request whose adapter was evicted from
memory waits in the queue while it is read back; the others go ahead of it.

The decode thread sets torch's process-wide intra-op thread count (`torch.set_num_threads`):
`threads` (default: torch's) for large steps, one for small ones; on a small machine
shared with other processes, 1 thread is often much faster than 2.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from liveloop.server.engine.adapters import AdapterEvents, AdapterTable
from liveloop.server.engine.base import EngineClient
from liveloop.server.engine.decode_loop import DecodeLoop
from liveloop.server.engine.forward import LlamaRunner, Prefill
from liveloop.server.engine.prefix_cache import PrefixCache
from liveloop.server.engine.state import (
    BetweenSteps,
    OutputSink,
    Request,
    default_max_len,
    deliver,
    eos_ids,
)
from liveloop.server.engine.stream import RequestStream, check_request
from liveloop.server.engine.types import (
    EngineError,
    EngineStats,
    SamplingParams,
    TokenOutput,
    UnknownAdapterError,
)
from liveloop.server.engine.weights import WeightSpec

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from liveloop.server.tools.spec import OutputSpec


class TorchEngine(DecodeLoop, EngineClient):
    """Continuous-batching generation with per-token log-probs and live weight swaps.

    `prefill_chunk_tokens` bounds the prompt tokens run per iteration (how long a joiner
    stalls the running requests); `prefix_cache_tokens` bounds the prefix cache (0 = off).
    On CPU, a step of fewer than `parallel_min_rows` rows (batch rows when decoding, prompt
    tokens when prefilling) runs on one torch thread: for a few rows, waking the other
    threads for every op costs more than it saves. `max_loaded_adapters` caps the LoRA
    adapters held in memory; `adapter_events` receives adapter events (see
    `adapters.AdapterEvents`; by default they go to the metrics of `bind_metrics`).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        max_batch_size: int = 16,
        max_model_len: int | None = None,
        device: str = "cpu",
        version: int = 0,
        prefill_chunk_tokens: int = 512,
        prefix_cache_tokens: int = 8192,
        parallel_min_rows: int = 16,
        threads: int | None = None,
        output_sink: OutputSink | None = None,
        max_loaded_adapters: int = 8,
        adapter_events: AdapterEvents | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        model.to(device)
        model.eval()
        self._runner = LlamaRunner(model)
        with torch.inference_mode():
            self._runner.self_check()
        self._weights = WeightSpec(model)
        self._tokenizer = tokenizer
        # The decode thread decodes stop-string windows with its own copy: a fast tokenizer
        # used by two threads at once can fail with "Already borrowed".
        self._stop_tokenizer = copy.deepcopy(tokenizer)
        self._eos = eos_ids(model, tokenizer)
        self._max_batch_size = max_batch_size
        self._prefill_chunk = max(1, prefill_chunk_tokens)
        self._staging: tuple[Request, Prefill] | None = None
        self._stats = EngineStats()
        self._prefix = PrefixCache(prefix_cache_tokens)
        self._swap_count = 0
        self._max_model_len = max_model_len or default_max_len(model)
        self._version = version
        self._cache = self._runner.new_cache(max_batch_size, self._max_model_len)
        self._cond = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._swaps: list[BetweenSteps] = []
        self._news = 0  # counts arrivals and adapter reads, to wake an idle decode thread
        self._stalled_at = -1  # _news when no waiting request could start
        self._adapters = AdapterTable(self._runner, max_loaded_adapters, self._wake, adapter_events)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._log = logging.getLogger(__name__)
        self._sink = output_sink  # where `submit()`ted requests' tokens go (decode thread)
        self._parallel_min_rows = parallel_min_rows if device == "cpu" else 0
        self._threads = threads or torch.get_num_threads()
        self._current_threads = 0  # set by the first step

    kind = "torch"

    # ----------------------------------------------------------------- properties
    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer."""
        return self._tokenizer

    @property
    def version(self) -> int:
        """Policy version of the weights now serving."""
        return self._version

    @property
    def max_model_len(self) -> int:
        """Longest prompt + completion the engine serves."""
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        """Size of the logits (the vocabulary a TokenConstraint mask covers)."""
        return self._runner.vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end a request unless `ignore_eos` is set."""
        return self._eos

    @property
    def num_running(self) -> int:
        """Requests in the decode batch (a cancelled one stops counting at once)."""
        with self._cond:
            return sum(1 for r in self._running if not (r.cancelled or r.done))

    @property
    def num_waiting(self) -> int:
        """Requests queued for a free batch slot."""
        with self._cond:
            return len(self._waiting)

    @property
    def stats(self) -> EngineStats:
        """A snapshot of the decode loop's cumulative counters."""
        return dataclasses.replace(self._stats)

    @property
    def is_running(self) -> bool:
        """True between start() and stop()."""
        return self._thread is not None and not self._stopping

    def bind_metrics(self, registry: CollectorRegistry) -> None:
        """Adapter metrics (reload waits, evictions), unless events go elsewhere."""
        from liveloop.server.engine.adapter_metrics import AdapterMetrics

        if self._adapters.events is None:
            self._adapters.events = AdapterMetrics(registry).observe

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Start the decode thread (idempotent)."""
        with self._cond:
            if self._thread is not None:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="torch-engine", daemon=True)
            self._thread.start()

    async def stop(self) -> None:
        """Stop the decode thread; requests still pending fail with EngineError."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join)
        with self._cond:
            pending = [*self._running, *self._waiting]
            self._running, self._waiting = [], deque()
            self._thread = None
        self._cache.clear()
        self._staging = None
        for req in pending:
            self._release(req)
        self._adapters.stop()
        deliver([(r, EngineError("engine stopped")) for r in pending], self._sink)
        await asyncio.to_thread(self._apply_swaps)  # validated swaps that raced with stop()

    # ----------------------------------------------------------------- requests
    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        affinity: str | None = None,
        adapter: str | None = None,
    ) -> RequestStream:
        """Queue a completion at once and stream its tokens (call from the consumer's loop).

        Raises ContextLengthError / InvalidRequestError (UnknownAdapterError for an adapter
        not loaded) / EngineError at once. Closing the stream early (`aclose()`, or
        dropping it) removes the request from the batch at once. `affinity` means nothing
        to a single engine.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenOutput | Exception] = asyncio.Queue()
        req = self._queue_request(prompt_token_ids, params, request_id, loop, queue, adapter)
        return RequestStream(queue, lambda: self._cancel(req))

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        adapter: str | None = None,
    ) -> None:
        """Queue a completion whose tokens go to the `output_sink` (engine worker process)."""
        if self._sink is None:
            raise EngineError("submit() needs an engine built with an output_sink")
        self._queue_request(prompt_token_ids, params, request_id, None, None, adapter)

    def check_grammar(self, grammar: OutputSpec) -> None:
        """Compile the grammar (compilations are cached); ToolRequestError if impossible."""
        from liveloop.server.tools import compile_output

        compile_output(self._tokenizer, grammar, self.vocab_size)

    def cancel(self, request_id: str) -> None:
        """Drop a `submit()`ted request (a no-op once it has finished)."""
        with self._cond:
            req = next(
                (r for r in (*self._waiting, *self._running) if r.request_id == request_id), None
            )
        if req is not None:
            self._cancel(req)

    def _queue_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None,
        loop: asyncio.AbstractEventLoop | None,
        queue: asyncio.Queue[TokenOutput | Exception] | None,
        adapter: str | None = None,
    ) -> Request:
        prompt = [int(t) for t in prompt_token_ids]
        check_request(prompt, params, self.vocab_size, self._max_model_len)
        if adapter is not None and adapter not in self._adapters.versions:
            raise UnknownAdapterError(f"adapter {adapter!r} is not loaded")
        if params.grammar is not None and params.constraint is None:
            from liveloop.server.tools import compile_output

            factory = compile_output(self._tokenizer, params.grammar, self.vocab_size)
            params = dataclasses.replace(params, constraint=factory.new())
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self._runner.device)
            generator.manual_seed(params.seed)
        req = Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt=prompt,
            params=params,
            loop=loop,
            queue=queue,
            generator=generator,
            stop_ids=frozenset(params.stop_token_ids)
            | (frozenset() if params.ignore_eos else self._eos),
            max_new=min(params.max_tokens, self._max_model_len - len(prompt)),
            adapter=adapter,
            arrived=time.monotonic(),
        )
        with self._cond:
            if not self.is_running:
                raise EngineError("engine is not running")
            self._waiting.append(req)
            self._news += 1
            self._cond.notify()
        return req

    def _wake(self) -> None:
        """Something the decode thread waits for happened (an adapter was read back)."""
        with self._cond:
            self._news += 1
            self._cond.notify()

    def _cancel(self, req: Request) -> None:
        if req.done or req.cancelled:
            return
        with self._cond:
            req.cancelled = True
            if req in self._waiting:
                self._waiting.remove(req)
            self._cond.notify()

    def clear_prefix_cache(self) -> None:
        """Forget all cached prompt keys/values (benchmarks; freeing memory)."""
        self._prefix.clear()

    # ----------------------------------------------------------------- weights
    def validate_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Check names, shapes, dtypes and finiteness; raise WeightValidationError if bad."""
        self._weights.validate(state_dict)

    async def load_weights(self, path: str, version: int) -> float:
        """Read a checkpoint directory or file, check it, swap it in; returns the pause (s).

        Raises CheckpointError when the files are unusable or do not fit the model.
        """
        from liveloop.weights import CheckpointError, load_checkpoint_state_dict

        def read() -> dict[str, torch.Tensor]:
            state_dict = load_checkpoint_state_dict(path)
            try:
                self._weights.validate(state_dict)
            except Exception as exc:
                raise CheckpointError(f"checkpoint {path} does not fit the model: {exc}") from exc
            return state_dict

        state_dict = await asyncio.to_thread(read)
        return await self._swap_validated(state_dict, version)

    async def swap_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> float:
        """Validate, then apply between two decode steps; returns the decode pause (s)."""
        await asyncio.to_thread(self._weights.validate, state_dict)
        return await self._swap_validated(state_dict, version)

    async def _swap_validated(self, state_dict: Mapping[str, torch.Tensor], version: int) -> float:
        return await self._between_steps(
            lambda: self._apply_swap(state_dict, version), f"weights v{version}"
        )

    async def load_adapter(self, name: str, version: int, path: str) -> float:
        """Read and check a PEFT adapter, then serve it as `name` v`version` between two
        decode steps (requests on it move to this version there); the decode pause (s).

        Raises AdapterError (a CheckpointError) when refused: the adapter's previous
        version, the base and every other adapter keep serving.
        """
        pairs = await asyncio.to_thread(self._adapters.read, str(path))

        def install() -> float:
            started = time.perf_counter()
            self._adapters.install(name, int(version), str(path), pairs)
            return time.perf_counter() - started

        return await self._between_steps(install, f"adapter {name} v{version}")

    async def unload_adapter(self, name: str) -> None:
        """Stop serving an adapter (requests decoding on it finish on it); new requests
        naming it get UnknownAdapterError."""
        if name not in self._adapters.versions:
            raise UnknownAdapterError(f"adapter {name!r} is not loaded")

        def unload() -> float:
            self._adapters.unload(name)
            return 0.0

        await self._between_steps(unload, f"unloading adapter {name}")

    def adapters(self) -> dict[str, int]:
        """The adapters served: name -> version."""
        return dict(self._adapters.versions)

    async def _between_steps(self, apply: Callable[[], float], what: str) -> float:
        """Run `apply` on the decode thread between two steps (at once when stopped)."""
        loop = asyncio.get_running_loop()
        pending = BetweenSteps(apply, what, loop, loop.create_future())
        with self._cond:
            queued = self._thread is not None
            if queued:
                self._swaps.append(pending)
                self._cond.notify()
        if not queued:  # no decode thread to pause: apply at once, off the event loop
            return await asyncio.to_thread(apply)
        return await pending.future

    def _apply_swap(self, state_dict: Mapping[str, torch.Tensor], version: int) -> float:
        started = time.perf_counter()
        self._weights.apply(state_dict)
        if self._runner.device.type == "cuda":
            torch.cuda.synchronize(self._runner.device)
        self._version = version
        self._swap_count += 1
        self._prefix.clear()
        pause = time.perf_counter() - started
        self._stats.weight_swaps += 1
        self._stats.swap_pause_seconds += pause
        return pause
