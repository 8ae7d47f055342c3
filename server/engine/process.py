"""The torch engine in a worker process of its own, behind the engine interface the server uses.

Why: the HTTP event loop and the decode loop are both Python. In one process they share
one GIL, so every SSE event the server writes delays the next decode step, and a decode
step delays the parsing of the next request: on a 2-core box at 32 streams that cost
~15% of tokens/s and tens of milliseconds of time to first token (bench/gateway.py). In a
worker process (`liveloop.server.engine.worker`) the decode loop has an interpreter to itself; the
server exchanges small pickled messages with it over a socket pair: requests and
cancellations one way, one message per decode step with every request's new token the
other way.

Request validation that needs the model (prompt length, token ids, sampling values)
happens here, up front, exactly as in TorchEngine, so bad input is still refused before
anything is sent. If the worker dies, every open request fails with EngineError (503), readiness turns
false, and a new worker is started (with backoff) and given the checkpoint the old one
last served before it takes requests, and the adapters it served.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import pickle
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from liveloop.children import die_with_parent
from liveloop.config import ServerConfig
from liveloop.models import ModelLoadError
from liveloop.server.engine.base import EngineClient
from liveloop.server.engine.stream import RequestStream, check_request
from liveloop.server.engine.types import (
    EngineError,
    EngineStats,
    SamplingParams,
    TokenOutput,
    UnknownAdapterError,
)

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from liveloop.server.engine.adapter_metrics import AdapterMetrics
    from liveloop.server.tools.spec import OutputSpec

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading (or first converting) a model can take minutes
STOP_TIMEOUT_S = 10.0
RESTART_BACKOFF_S = (1.0, 30.0)  # first and longest wait before restarting a dead worker
STABLE_S = 60.0  # a worker that lived this long resets the backoff


@dataclass(frozen=True)
class EngineOptions:
    """What the worker needs to build its TorchEngine."""

    model: str
    device: str = "cpu"
    max_batch_size: int = 16
    max_model_len: int | None = None
    torch_threads: int | None = None
    max_loaded_adapters: int = 8

    @classmethod
    def from_config(cls, model: str, cfg: ServerConfig) -> EngineOptions:
        """The options of a model and the `server` settings section."""
        return cls(
            model=model,
            device=cfg.device,
            max_batch_size=cfg.max_batch_size,
            max_model_len=cfg.max_model_len,
            torch_threads=cfg.torch_threads,
            max_loaded_adapters=cfg.max_loaded_adapters,
        )


class EngineProcess(EngineClient):
    """A TorchEngine in a child process; `generate`, `load_weights` and the counters as usual.

    `spawn()` (blocking: start the worker and wait until its model is loaded) may run
    before the event loop exists, so a model that cannot load fails start-up with one line;
    `start()` then attaches the socket to the running loop.
    """

    kind = "torch"

    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self._tokenizer: Any = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._info: dict[str, Any] = {}
        self._streams: dict[str, asyncio.Queue[TokenOutput | Exception]] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = 0
        self._waiting = 0
        self._alive = False
        self._stopping = False
        self._restoring = False  # a restarted worker is getting its weights back
        self._weights: tuple[str, int] | None = None  # the last checkpoint swapped in
        self._adapters: dict[str, tuple[int, str]] = {}  # name -> (version, path) served
        self._metrics: AdapterMetrics | None = None
        self._restart_task: asyncio.Task[None] | None = None
        self._started_at = 0.0
        self._backoff = RESTART_BACKOFF_S[0]

    # ----------------------------------------------------------------- lifecycle
    def spawn(self) -> None:
        """Start the worker and wait for its model; ModelLoadError with the reason if not."""
        self._launch()
        self._await_hello()

    async def start(self) -> None:
        """Spawn if needed (waiting off the loop), then read the worker's messages here."""
        if self._tokenizer is None:  # the server renders prompts; the worker has its own
            from liveloop.models import load_tokenizer

            self._tokenizer = await asyncio.to_thread(load_tokenizer, self.options.model)
        if self._proc is None:
            self._launch()  # on this thread: the worker dies with the thread that started it
            await asyncio.to_thread(self._await_hello)
        if self._loop is None:
            assert self._conn is not None
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._conn.fileno(), self._on_readable)
            self._started_at = time.monotonic()

    async def _restart(self) -> None:
        """Start a new worker after a crash and give it back the weights it served."""
        while not self._stopping:
            await asyncio.sleep(self._backoff)
            self._backoff = min(2 * self._backoff, RESTART_BACKOFF_S[1])
            self._restoring = self._weights is not None or bool(self._adapters)
            try:
                await self.start()
                if self._weights is not None:
                    await self._load(*self._weights)
                await self._restore_adapters()
            except Exception as exc:
                log.error("restarting the engine worker failed (%s); retrying", exc)
                self._lost("the engine worker is restarting")
                self._kill()
                continue
            finally:
                self._restoring = False
            log.warning("the engine worker was restarted (policy v%d)", self.version)
            return

    def _launch(self) -> None:
        if self._proc is not None:
            return
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # Idle OpenMP workers sleep instead of spinning, leaving the CPU to the HTTP server.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        cmd = [sys.executable, "-m", "liveloop.server.engine.worker", str(theirs.fileno())]
        self._proc = subprocess.Popen(
            [*cmd, json.dumps(self.options.__dict__)],
            pass_fds=[theirs.fileno()],
            env=env,
            preexec_fn=die_with_parent,
        )
        theirs.close()
        self._conn = Connection(ours.detach())

    def _await_hello(self) -> None:
        if self._alive:
            return
        assert self._conn is not None and self._proc is not None
        try:
            if not self._conn.poll(START_TIMEOUT_S):
                raise ModelLoadError("the engine worker did not start in time")
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            kind, payload = "failed", f"the engine worker exited (code {self._proc.wait()})"
        except ModelLoadError as exc:
            kind, payload = "failed", str(exc)
        if kind != "hello":
            self._kill()
            raise ModelLoadError(str(payload))
        self._info = payload
        self._alive = True

    async def stop(self) -> None:
        """Stop the worker (open requests fail with EngineError)."""
        self._stopping = True
        if self._restart_task is not None:
            self._restart_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._restart_task
        proc, conn = self._proc, self._conn
        if proc is None or conn is None:
            return
        with contextlib.suppress(OSError):
            conn.send(("stop",))
        try:
            await asyncio.to_thread(proc.wait, STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("the engine worker did not stop in %.0fs; killing it", STOP_TIMEOUT_S)
        self._lost("engine stopped")
        self._kill()

    def _kill(self) -> None:
        if self._loop is not None and self._conn is not None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(self._conn.fileno())
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn, self._loop = None, None, None

    # ----------------------------------------------------------------- properties
    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer, loaded in this process by `start()`."""
        return self._tokenizer

    @property
    def version(self) -> int:
        """Policy version of the weights being served."""
        return int(self._info.get("version", 0))

    @property
    def max_model_len(self) -> int:
        """Context window in tokens."""
        return int(self._info["max_model_len"])

    @property
    def vocab_size(self) -> int:
        """Width of the model's logits."""
        return int(self._info["vocab_size"])

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end a request unless `ignore_eos` is set."""
        return frozenset(self._info["eos_token_ids"])

    @property
    def num_running(self) -> int:
        """Requests in the decode batch (as of the worker's last message)."""
        return self._running

    @property
    def num_waiting(self) -> int:
        """Requests queued for a batch slot (as of the worker's last message)."""
        return self._waiting

    @property
    def is_running(self) -> bool:
        """True while the worker is up and serving the weights it should."""
        return self._alive and self._loop is not None and not self._restoring

    @property
    def stats(self) -> EngineStats:
        """Decode-loop counters are kept in the worker; not reported across the process."""
        return EngineStats()

    def bind_metrics(self, registry: CollectorRegistry) -> None:
        """The worker's adapter metrics (its events come over the socket)."""
        from liveloop.server.engine.adapter_metrics import AdapterMetrics

        self._metrics = AdapterMetrics(registry)

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
        """Queue a completion at once and stream its tokens (see TorchEngine.generate)."""
        prompt = [int(t) for t in prompt_token_ids]
        check_request(prompt, params, self.vocab_size, self.max_model_len)
        if adapter is not None and adapter not in self._adapters:
            raise UnknownAdapterError(f"adapter {adapter!r} is not loaded")
        if params.constraint is not None:  # a compiled grammar: send its description
            grammar = getattr(params.constraint, "spec", None)
            if grammar is None:
                raise EngineError("this output constraint cannot be sent to the engine worker")
            params = replace(params, constraint=None, grammar=grammar)
        if not self.is_running:
            raise EngineError("engine is not running")
        rid = request_id or uuid.uuid4().hex
        queue: asyncio.Queue[TokenOutput | Exception] = asyncio.Queue()
        self._streams[rid] = queue
        self._send(("add", rid, prompt, params, adapter))
        return RequestStream(queue, lambda: self._cancel(rid))

    def check_grammar(self, grammar: OutputSpec) -> None:
        """Compile the grammar here (cached) so a bad schema is refused before sending."""
        from liveloop.server.tools import compile_output

        compile_output(self._tokenizer, grammar, self.vocab_size)

    def _cancel(self, rid: str) -> None:
        """Drop a request; safe from any thread (a stream may be garbage-collected anywhere)."""
        loop = self._loop
        if self._streams.pop(rid, None) is None or not self.is_running or loop is None:
            return
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._send_quietly(("cancel", rid))
        else:  # one writer only: the socket is not safe to share between threads
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to cancel
                loop.call_soon_threadsafe(self._send_quietly, ("cancel", rid))

    def _send_quietly(self, message: tuple[Any, ...]) -> None:
        with contextlib.suppress(EngineError):  # a lost worker has already failed everything
            self._send(message)

    def clear_prefix_cache(self) -> None:
        """Forget the worker's cached prompt keys/values."""
        self._send(("clear_prefix_cache",))

    async def load_weights(self, path: str, version: int) -> float:
        """Have the worker read, check and swap in a checkpoint; returns the decode pause (s)."""
        if not self.is_running:
            raise EngineError("engine is not running")
        pause = await self._load(path, version)
        self._weights = (str(path), int(version))
        return pause

    async def _load(self, path: str, version: int) -> float:
        pause = await self._call("load", str(path), int(version))
        self._info["version"] = int(version)
        return float(pause)

    async def load_adapter(self, name: str, version: int, path: str) -> float:
        """Have the worker read, check and serve an adapter version (see TorchEngine)."""
        if not self.is_running:
            raise EngineError("engine is not running")
        pause = await self._call("load_adapter", name, int(version), str(path))
        self._adapters[name] = (int(version), str(path))
        return float(pause)

    async def unload_adapter(self, name: str) -> None:
        """Have the worker stop serving an adapter."""
        if name not in self._adapters:
            raise UnknownAdapterError(f"adapter {name!r} is not loaded")
        await self._call("unload_adapter", name)
        self._adapters.pop(name, None)

    def adapters(self) -> dict[str, int]:
        """The adapters served: name -> version."""
        return {name: version for name, (version, _) in self._adapters.items()}

    async def _restore_adapters(self) -> None:
        """A restarted worker: serve again the adapters the old one served."""
        for name, (version, path) in list(self._adapters.items()):
            try:
                await self._call("load_adapter", name, version, path)
            except EngineError:
                raise  # the new worker is gone too: the restart loop tries again
            except Exception as exc:
                log.error("adapter %s v%d could not be restored (%s); dropped", name, version, exc)
                self._adapters.pop(name, None)

    async def _call(self, kind: str, *args: Any) -> Any:
        """Send a command the worker answers with a reply; its result (or its error)."""
        if not self._alive or self._loop is None:
            raise EngineError("engine is not running")
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = self._loop.create_future()
        self._calls[call_id] = future
        self._send((kind, call_id, *args))
        return await future

    def _send(self, message: tuple[Any, ...]) -> None:
        if self._conn is None:
            raise EngineError("engine is not running")
        try:
            # Plain pickle: Connection.send's ForkingPickler costs more, for fds we never send.
            self._conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))
        except OSError as exc:
            self._lost(f"the engine worker is gone ({exc})")
            raise EngineError("engine is not running") from None

    # ----------------------------------------------------------------- worker messages
    def _on_readable(self) -> None:
        conn = self._conn
        try:
            while conn is not None and conn.poll():
                self._dispatch(conn.recv())
        except (EOFError, OSError):
            self._lost("the engine worker exited")
            if not self._stopping:
                self._on_crash()

    def _on_crash(self) -> None:
        """The worker died on its own: 503s until a new one is up (see `_restart`)."""
        loop = self._loop
        code = self._proc.poll() if self._proc is not None else None
        log.error("the engine worker exited (code %s); requests get 503 until it is back", code)
        if time.monotonic() - self._started_at > STABLE_S:
            self._backoff = RESTART_BACKOFF_S[0]
        self._kill()
        if loop is not None and not loop.is_closed():
            self._restart_task = loop.create_task(self._restart(), name="engine-restart")

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "out":
            _, items, self._running, self._waiting = message
            for rid, item in items:
                queue = self._streams.get(rid)
                if queue is None:
                    continue
                if isinstance(item, Exception):
                    del self._streams[rid]
                    queue.put_nowait(item)
                    continue
                out = TokenOutput(*item)
                if out.finish_reason is not None:
                    del self._streams[rid]
                queue.put_nowait(out)
        elif kind == "event":
            if self._metrics is not None:
                self._metrics.observe(message[1], message[2])
        elif kind == "reply":
            future = self._calls.pop(message[1], None)
            if future is not None and not future.done():
                result = message[2]
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)

    def _lost(self, reason: str) -> None:
        """Fail everything open: the worker will not answer any more."""
        self._alive = False
        streams, self._streams = self._streams, {}
        for queue in streams.values():
            queue.put_nowait(EngineError(reason))
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(EngineError(reason))
        self._running = self._waiting = 0
