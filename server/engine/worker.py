"""The engine worker process: a TorchEngine driven over a socket by `EngineProcess`.

Started as `python -m server.engine.worker <fd> <options json>` with one end of a socket
pair as `fd`. It loads the model, answers `("hello", info)` (or `("failed", reason)`),
then serves commands (read on a thread of their own) until told to stop or until the
server's end of the socket closes:

    ("add", request_id, prompt_ids, params, adapter)   queue a completion (params.grammar:
                                                       plain data; adapter: a name or None)
    ("cancel", request_id)                                       drop one
    ("load", call_id, path, version)                             hot-swap a checkpoint
    ("load_adapter", call_id, name, version, path)               serve an adapter version
    ("unload_adapter", call_id, name)                            stop serving an adapter
    ("clear_prefix_cache",)  ("stop",)

Tokens go back from the decode thread itself, one `("out", [(request_id, item), ...],
running, waiting)` message per decode step, where an item is a token tuple
(`TokenOutput` fields in order) or an exception; `("reply", call_id, result)` answers a
load; `("event", name, value)` reports an adapter event (reload waits, evictions) for the
server's metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import pickle
import sys
import threading
from collections.abc import Coroutine
from multiprocessing.connection import Connection
from typing import Any

from liveloop.logs import setup_logging

log = logging.getLogger("liveloop.server.engine.worker")


def wire_error(exc: BaseException) -> Exception:
    """An exception that pickles and keeps its meaning (engine and checkpoint errors as is)."""
    from liveloop.server.engine.types import EngineError
    from liveloop.weights import CheckpointError

    if isinstance(exc, EngineError | CheckpointError) and type(exc).__module__.startswith(
        "liveloop."  # liveloop.server.engine.types, liveloop.weights
    ):
        return exc
    return EngineError(f"{type(exc).__name__}: {exc}")


def as_tuple(out: Any) -> tuple[Any, ...]:
    """A TokenOutput's fields in order (cheaper to pickle than the dataclass)."""
    return (
        out.token_id,
        out.logprob,
        out.version,
        out.top_logprobs,
        out.finish_reason,
        out.stop_string,
    )


class Worker:
    """Owns the engine and the socket; commands come in on a reader thread."""

    def __init__(self, conn: Connection, options: dict[str, Any]) -> None:
        self.conn = conn
        self.options = options
        self.send_lock = threading.Lock()
        self.stopped = asyncio.Event()
        self.engine: Any = None
        self.tokenizer: Any = None
        self.tasks: set[asyncio.Task[None]] = set()

    def send(self, message: tuple[Any, ...]) -> None:
        """Send one message (the decode thread, the reader thread and the event loop send)."""
        # OSError: the server is gone; the read side notices and stops the worker.
        with self.send_lock, contextlib.suppress(OSError, EOFError):
            self.conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))

    def on_outputs(self, items: list[tuple[str, Any]]) -> None:
        """Decode thread: one message per step with every request's new token."""
        wire = [
            (rid, item if isinstance(item, Exception) else as_tuple(item)) for rid, item in items
        ]
        engine = self.engine
        self.send(("out", wire, engine.num_running, engine.num_waiting))

    def on_adapter_event(self, name: str, value: float) -> None:
        """Decode or loader thread: an adapter event, for the server's metrics."""
        self.send(("event", name, value))

    async def open(self) -> None:
        """Load the model and start the engine; says hello (or why not) to the server."""
        from liveloop.models import load_model
        from liveloop.server.engine.torch_engine import TorchEngine

        opts = self.options
        try:
            loaded = await asyncio.to_thread(load_model, opts["model"], opts["device"])
            self.tokenizer = loaded.tokenizer
            self.engine = TorchEngine(
                loaded.model,
                loaded.tokenizer,
                max_batch_size=opts["max_batch_size"],
                max_model_len=opts["max_model_len"],
                device=opts["device"],
                threads=opts["torch_threads"],
                output_sink=self.on_outputs,
                max_loaded_adapters=opts.get("max_loaded_adapters", 8),
                adapter_events=self.on_adapter_event,
            )
            await self.engine.start()
        except Exception as exc:
            self.send(("failed", str(exc)))
            raise SystemExit(1) from None
        info = {
            "vocab_size": int(self.engine.vocab_size),
            "max_model_len": int(self.engine.max_model_len),
            "eos_token_ids": sorted(self.engine.eos_token_ids),
            "version": int(self.engine.version),
        }
        self.send(("hello", info))

    def read_commands(self, loop: asyncio.AbstractEventLoop) -> None:
        """Reader thread: requests and cancellations go to the engine as they arrive.

        Not through the event loop: one thread wake-up less before a request's prefill
        starts (the engine's submit and cancel are thread-safe). Loads and stop need the
        loop and are handed to it.
        """
        try:
            while True:
                message = pickle.loads(self.conn.recv_bytes())
                if message[0] in ("load", "load_adapter", "unload_adapter", "stop"):
                    loop.call_soon_threadsafe(self.handle, message)
                    continue
                try:
                    self.handle(message)
                except Exception:  # a bad command must not stop the reading
                    log.exception("engine worker: command %r failed", message[0])
        except (EOFError, OSError):  # the server closed its end: stop
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                loop.call_soon_threadsafe(self.stopped.set)

    def handle(self, message: tuple[Any, ...]) -> None:
        """One command."""
        kind = message[0]
        if kind == "add":
            self.add(*message[1:])
        elif kind == "cancel":
            self.engine.cancel(message[1])
            self.on_outputs([])  # the new counts: a cancelled request stops counting at once
        elif kind == "load":
            self.reply_later(message[1], self.engine.load_weights(message[2], message[3]))
        elif kind == "load_adapter":
            self.reply_later(message[1], self.engine.load_adapter(*message[2:5]))
        elif kind == "unload_adapter":
            self.reply_later(message[1], self.engine.unload_adapter(message[2]))
        elif kind == "clear_prefix_cache":
            self.engine.clear_prefix_cache()
        elif kind == "stop":
            self.stopped.set()

    def add(
        self, request_id: str, prompt: list[int], params: Any, adapter: str | None = None
    ) -> None:
        """Queue a completion (the engine compiles its grammar); a refusal goes back as
        that request's only item."""
        try:
            self.engine.submit(prompt, params, request_id, adapter)
        except Exception as exc:
            self.send(("out", [(request_id, wire_error(exc))], 0, 0))

    def reply_later(self, call_id: int, call: Coroutine[Any, Any, Any]) -> None:
        """Run a weights or adapter call on the loop; its result or error is the reply."""
        task = asyncio.create_task(self.reply(call_id, call))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def reply(self, call_id: int, call: Coroutine[Any, Any, Any]) -> None:
        """Await a call and send its result (the pause, None) or its error back."""
        try:
            result: Any = await call
        except Exception as exc:
            result = wire_error(exc)
        self.send(("reply", call_id, result))

    async def serve(self) -> None:
        """Open, then handle commands until stopped; the engine stops last."""
        await self.open()
        loop = asyncio.get_running_loop()
        # A daemon: it may still be blocked reading when the worker exits.
        reader = threading.Thread(
            target=self.read_commands, args=(loop,), name="engine-commands", daemon=True
        )
        reader.start()
        try:
            await self.stopped.wait()
        finally:
            await self.engine.stop()


def main() -> None:
    """Entry point of `python -m server.engine.worker <fd> <options json>`."""
    setup_logging("WARNING", "engine")
    fd, options = int(sys.argv[1]), json.loads(sys.argv[2])
    conn = Connection(fd)
    try:
        asyncio.run(Worker(conn, options).serve())
    except KeyboardInterrupt:
        pass
    finally:
        conn.close()


if __name__ == "__main__":
    main()
