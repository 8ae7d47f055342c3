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
import contextlib
import copy
import dataclasses
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from liveloop.server.engine.adapters import AdapterEvents, AdapterTable
from liveloop.server.engine.base import EngineClient
from liveloop.server.engine.forward import LlamaRunner, Prefill
from liveloop.server.engine.prefix_cache import PrefixCache
from liveloop.server.engine.sampling import Sampled, sample_batch
from liveloop.server.engine.state import (
    BetweenSteps,
    OutputSink,
    Request,
    default_max_len,
    deliver,
    eos_ids,
    finish_reason,
    settle,
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


class TorchEngine(EngineClient):
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

    def _apply_swaps(self) -> None:
        with self._cond:
            swaps, self._swaps = self._swaps, []
        for swap in swaps:
            try:
                result: float | Exception = swap.apply()
            except Exception as exc:
                self._log.exception("applying %s failed", swap.what)
                result = EngineError(
                    f"applying {swap.what} failed (model may be partly updated): {exc}"
                )
            with contextlib.suppress(RuntimeError):  # the swapper's event loop is gone
                swap.loop.call_soon_threadsafe(settle, swap.future, result)

    # ----------------------------------------------------------------- decode thread
    def _run(self) -> None:
        with torch.inference_mode():
            while self._wait_for_work():
                cpu = time.thread_time()
                try:
                    self._iteration()
                except Exception as exc:
                    self._log.exception("torch engine decode iteration failed")
                    self._fail_running(EngineError(f"generation failed: {exc}"))
                self._stats.busy_cpu_seconds += time.thread_time() - cpu

    def _wait_for_work(self) -> bool:
        with self._cond:
            while not self._stopping and not (
                self._running or self._swaps or (self._waiting and self._stalled_at != self._news)
            ):
                self._cond.wait()
            return not self._stopping

    def _iteration(self) -> None:
        self._apply_swaps()
        self._adapter_reloads()
        self._reap()
        self._admit()
        if self._running:
            started = time.perf_counter()
            rows = list(self._running)
            self._use_threads(len(rows))
            lora = self._adapters.step([r.lora for r in rows])
            logits = self._runner.decode(self._cache, [r.output[-1] for r in rows], lora)
            self._process(rows, logits)
            self._stats.decode_steps += 1
            self._stats.decode_tokens += len(logits)
            self._stats.decode_seconds += time.perf_counter() - started

    def _admit(self) -> None:
        """Prefill the oldest waiting request, at most `prefill_chunk_tokens` per iteration.

        Chunking bounds how long a long prompt stalls the running requests' next token. A
        fully prefilled prompt joins the batch and emits its first token.
        """
        budget = self._prefill_chunk
        while budget > 0 and len(self._running) < self._max_batch_size:
            req = self._next_request()
            if req is None:
                return
            if self._staging is None or self._staging[0] is not req:
                self._staging = (req, self._start_prefill(req))
            state = self._staging[1]
            take = min(budget, state.remaining)
            budget -= take
            started = time.perf_counter()
            self._use_threads(take)
            logits = self._runner.prefill_step(state, take, self._adapters.step([req.lora]))
            self._stats.prefill_tokens += take
            self._stats.prefill_seconds += time.perf_counter() - started
            if logits is None:
                return
            self._staging = None
            if self._kv_current(req):  # no swap during the prefill
                self._prefix.insert(req.prompt, state.keys, state.values, req.kv_key)
            with self._cond:
                if req.cancelled:  # _cancel already took it out of the queue
                    self._release(req)
                    continue
                self._waiting.remove(req)
                self._running.append(req)
            self._runner.join(self._cache, state)
            self._process([req], logits[None])

    def _next_request(self) -> Request | None:
        """The prompt to prefill now: the one being prefilled, else the oldest waiting
        request whose adapter is in memory.

        Requests whose adapter is not have it read back (they keep their place; adapters
        other waiting requests need are not evicted for that); requests on an adapter
        unloaded meanwhile fail. With nothing startable and nothing running,
        the decode thread sleeps until a request or an adapter arrives.
        """
        if self._staging is not None:
            if not self._staging[0].cancelled:
                return self._staging[0]
            self._release(self._staging[0])
            self._staging = None
        with self._cond:
            waiting = list(self._waiting)
            news = self._news
        gone: list[Request] = []
        chosen = None
        needed = {r.adapter: self._adapters.get(r.adapter) for r in waiting if r.adapter}
        keep = {a for a in needed.values() if a is not None and a.ready}
        for req in waiting:
            adapter = needed.get(req.adapter) if req.adapter is not None else None
            if req.adapter is None or (adapter is not None and adapter.ready):
                chosen = chosen or req
            elif adapter is None:
                gone.append(req)
            else:
                req.adapter_wait_since = req.adapter_wait_since or time.monotonic()
                self._adapters.ensure_loading(adapter, keep)
        self._fail_waiting(
            [(r, UnknownAdapterError(f"adapter {r.adapter!r} was unloaded")) for r in gone]
        )
        if chosen is None and not self._running:
            with self._cond:  # unless a request or an adapter came meanwhile
                self._stalled_at = news
        return chosen

    def _fail_waiting(self, failed: list[tuple[Request, EngineError]]) -> None:
        with self._cond:
            for req, _ in failed:
                if req in self._waiting:
                    self._waiting.remove(req)
                req.done = True
        deliver(list(failed), self._sink)

    def _adapter_reloads(self) -> None:
        """Put adapters read back into their slots; fail the requests of failed reads."""
        for adapter, exc in self._adapters.finished_reloads():
            with self._cond:
                reqs = [r for r in self._waiting if r.adapter == adapter.name]
            why = f"adapter {adapter.name!r} could not be read back from {adapter.path}: {exc}"
            self._fail_waiting([(r, EngineError(why)) for r in reqs])

    def _release(self, req: Request) -> None:
        """A request is over: unpin its adapter (once)."""
        if req.lora is not None:
            self._adapters.release(req.lora)
            req.lora = None

    def _kv_key(self, req: Request) -> Hashable:
        """The prefix-cache namespace of the weights the request runs on now."""
        return None if req.lora is None else ("adapter", req.lora.generation)

    def _kv_current(self, req: Request) -> bool:
        """Whether the request's keys/values all come from the weights served now."""
        return req.kv_epoch == self._swap_count and req.kv_key == self._kv_key(req)

    def _use_threads(self, rows: int) -> None:
        """All torch threads for a step of many rows, one for a small step."""
        want = self._threads if rows >= self._parallel_min_rows else 1
        if want != self._current_threads:
            torch.set_num_threads(want)
            self._current_threads = want

    def _start_prefill(self, req: Request) -> Prefill:
        if req.adapter is not None:
            req.lora = self._adapters.get(req.adapter)
            assert req.lora is not None and req.lora.ready
            self._adapters.acquire(req.lora)
            if req.adapter_wait_since:  # it waited for its adapter to be read back
                self._adapters.emit_wait(time.monotonic() - req.adapter_wait_since)
        state = self._runner.start_prefill(req.prompt)
        req.kv_epoch = self._swap_count
        req.kv_key = self._kv_key(req)
        self._stats.prefix_hit_tokens += self._prefix.seed(state, req.kv_key)
        return state

    def _remember(self, req: Request, row: int) -> None:
        """Offer a finished request's prompt + completion keys/values to the prefix cache."""
        tokens = req.prompt + req.output[:-1]
        if (
            self._prefix.max_tokens >= len(tokens) > len(req.prompt)
            and self._kv_current(req)
            and self._cache.lengths[row] == len(tokens)
        ):
            self._prefix.insert(tokens, *self._cache.row_copy(row), namespace=req.kv_key)

    def _reap(self) -> None:
        """Remove finished and cancelled rows (the last row moves into each hole)."""
        for i in reversed(range(len(self._running))):
            req = self._running[i]
            if req.done or req.cancelled:
                self._remember(req, i)
                self._cache.remove_row(i)
                self._release(req)
                with self._cond:
                    self._running[i] = self._running[-1]
                    self._running.pop()

    def _fail_running(self, error: EngineError) -> None:
        """After an internal failure: fail the batch and the prompt being prefilled."""
        with self._cond:
            failed, self._running = self._running, []
            if self._staging is not None and self._staging[0] in self._waiting:
                self._waiting.remove(self._staging[0])
                failed.append(self._staging[0])
            self._staging = None
        self._cache.clear()
        for req in failed:
            req.done = True
            self._release(req)
        deliver([(r, EngineError(str(error))) for r in failed], self._sink)

    def _process(self, reqs: list[Request], logits: torch.Tensor) -> None:
        """Sample each row, record the token, decide whether it ends, hand it out.

        A row on an adapter records the adapter's version, others the base's.
        """
        sampled = sample_batch(logits, [r.params for r in reqs], [r.generator for r in reqs])
        out: list[tuple[Request, TokenOutput | Exception]] = []
        for req, result in zip(reqs, sampled, strict=True):
            if req.cancelled:
                continue
            try:
                if isinstance(result, Exception):
                    raise result
                version = self._version if req.lora is None else req.lora.version
                out.append((req, self._advance(req, result, version)))
            except Exception as exc:
                req.done = True
                out.append((req, EngineError(f"sampling failed: {exc}")))
        deliver(out, self._sink)
        self._reap()

    def _advance(self, req: Request, sampled: Sampled, version: int) -> TokenOutput:
        token = sampled.token_id
        req.output.append(token)
        params = req.params
        if params.constraint is not None:
            params.constraint.accept_token(token)
        finish, stop_string = finish_reason(req, token, self._stop_tokenizer)
        req.done = finish is not None
        return TokenOutput(
            token, sampled.logprob, version, sampled.top_logprobs, finish, stop_string
        )
