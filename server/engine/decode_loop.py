"""The decode thread of the torch engine: admission, prefill, batched decode, sampling.

Kept apart from `torch_engine.py` so that file reads as the engine's interface (requests,
weights, adapters) and this one as the loop that runs them. Everything here runs on the
decode thread, except where it takes `_cond` to exchange requests with other threads.
`DecodeLoop` is a mixin: `TorchEngine` builds the state it declares.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Hashable
from typing import Any

import torch

from liveloop.server.engine.adapters import Adapter, AdapterTable
from liveloop.server.engine.forward import LlamaRunner, Prefill
from liveloop.server.engine.kv_cache import BatchKVCache
from liveloop.server.engine.prefix_cache import PrefixCache
from liveloop.server.engine.sampling import Sampled, sample_batch
from liveloop.server.engine.state import (
    BetweenSteps,
    OutputSink,
    Request,
    deliver,
    finish_reason,
    settle,
)
from liveloop.server.engine.types import (
    EngineError,
    EngineStats,
    TokenOutput,
    UnknownAdapterError,
)


class DecodeLoop:
    """The decode thread's iterations over the state `TorchEngine.__init__` builds."""

    _runner: LlamaRunner
    _cache: BatchKVCache
    _prefix: PrefixCache
    _adapters: AdapterTable
    _cond: threading.Condition
    _waiting: deque[Request]
    _running: list[Request]
    _swaps: list[BetweenSteps]
    _staging: tuple[Request, Prefill] | None
    _stats: EngineStats
    _stopping: bool
    _news: int  # counts arrivals and adapter reads, to wake an idle decode thread
    _stalled_at: int  # _news when no waiting request could start
    _swap_count: int
    _version: int
    _max_batch_size: int
    _prefill_chunk: int
    _parallel_min_rows: int
    _threads: int
    _current_threads: int
    _sink: OutputSink | None
    _stop_tokenizer: Any
    _log: logging.Logger

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
        fully prefilled prompt joins the batch and emits its first token. An iteration
        admits at most `max_batch_size` prompts and none once a weight swap is waiting: a
        prompt found in the prefix cache costs almost nothing of the budget and a one-token
        request leaves the batch at once, so a stream of them would otherwise hold back the
        running requests' next token and every swap.
        """
        budget, admitted = self._prefill_chunk, 0
        while (
            budget > 0
            and admitted < self._max_batch_size
            and len(self._running) < self._max_batch_size
            and not self._swaps
        ):
            admitted += 1
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

        Requests whose adapter is not have it read back, in queue order (a reload never
        evicts an adapter an older waiting request needs). Once one cannot even get a
        memory slot (every slot held by running requests), no newer request on an adapter
        starts before it, so the running ones drain and free a slot. Requests on an
        adapter unloaded meanwhile fail. With nothing startable and nothing running, the
        decode thread sleeps until a request or an adapter arrives.
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
        chosen: Request | None = None
        keep: set[Adapter] = set()  # adapters of older waiting requests, ready to run
        blocked = False  # an older request waits for a memory slot
        for req in waiting:
            if req.adapter is None:
                chosen = chosen or req
                continue
            adapter = self._adapters.get(req.adapter)
            if adapter is None:
                gone.append(req)
            elif adapter.ready:
                keep.add(adapter)
                if not blocked:
                    chosen = chosen or req
            else:
                req.adapter_wait_since = req.adapter_wait_since or time.monotonic()
                blocked |= not self._adapters.ensure_loading(adapter, keep)
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
