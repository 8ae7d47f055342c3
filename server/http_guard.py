"""Connection-level limits uvicorn does not set: slow, silent and oversized clients.

uvicorn arms no timer on a new connection (one that sends nothing, or its headers a byte at
a time, is kept forever), accepts headers of any size with httptools, and waits forever on
a client that stops reading a response. `guarded_protocol()` returns uvicorn's httptools
protocol with three limits on top:

- a request (head and body) must arrive within `read_timeout_s` of its first byte (of the
  connection, for the first request); a head that does not gets 408, a body is cut off;
- a request head over `max_header_bytes` gets 431 before it is parsed further;
- a response whose writes stay blocked for `write_stall_timeout_s` (the client stopped
  reading) is aborted, so the request is cancelled and its engine slot and buffers freed.

Each ends with the connection closed and `on_close(reason)` called (the server counts them
in `liveloop_http_connections_closed_total{reason}`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

REASONS = ("read_timeout", "header_too_large", "write_stall")


def _reply(status: int, reason: str, message: str) -> bytes:
    error = {
        "message": message,
        "type": "invalid_request_error",
        "param": None,
        "code": reason.lower().replace(" ", "_"),
    }
    body = json.dumps({"error": error}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode()
    return head + body


def guarded_protocol(
    *,
    max_header_bytes: int,
    read_timeout_s: float,
    write_stall_timeout_s: float,
    on_close: Callable[[str], None] = lambda _reason: None,
) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol class with the three limits (pass it as `http=`)."""

    class GuardedProtocol(HttpToolsProtocol):
        """HttpToolsProtocol with read, header-size and write-stall limits."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_bytes = 0
            self._tail = b""  # the last bytes of the head so far (to find its end)
            self._in_head = True
            self._in_request = True
            self._read_timer: asyncio.TimerHandle | None = None
            self._stall_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_read()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_timers()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if not self._in_request:  # the first byte of the next request on this connection
                self._in_request = self._in_head = True
                self._head_bytes, self._tail = 0, b""
                self._arm_read()
            if self._in_head:  # count head bytes only, not a body sent in the same packet
                window = self._tail + data
                end = window.find(b"\r\n\r\n")
                self._head_bytes += len(data) if end < 0 else max(0, end + 4 - len(self._tail))
                self._tail = window[-3:]
                if self._head_bytes > max_header_bytes:
                    on_close("header_too_large")
                    self._refuse(
                        431, "Request Header Fields Too Large", "request headers too large"
                    )
                    return
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_request = False
            self._cancel(self._read_timer)
            self._read_timer = None
            super().on_message_complete()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._stall_timer is None:
                self._stall_timer = self.loop.call_later(write_stall_timeout_s, self._stalled)

        def resume_writing(self) -> None:
            self._cancel(self._stall_timer)
            self._stall_timer = None
            super().resume_writing()

        def _arm_read(self) -> None:
            self._cancel(self._read_timer)
            self._read_timer = self.loop.call_later(read_timeout_s, self._read_timed_out)

        def _read_timed_out(self) -> None:
            self._read_timer = None
            if self.transport.is_closing():
                return
            on_close("read_timeout")
            if self._in_head and (self.cycle is None or self.cycle.response_complete):
                self._refuse(408, "Request Timeout", "the request was not received in time")
            else:  # a body that stopped arriving: the app sees a disconnect
                self.transport.abort()

        def _stalled(self) -> None:
            self._stall_timer = None
            if not self.transport.is_closing():
                on_close("write_stall")
            self.transport.abort()  # close() would wait for the stuck buffer to drain

        def _refuse(self, status: int, reason: str, message: str) -> None:
            if not self.transport.is_closing():
                self.transport.write(_reply(status, reason, message))
                self.transport.close()

        def _cancel_timers(self) -> None:
            for timer in (self._read_timer, self._stall_timer):
                self._cancel(timer)
            self._read_timer = self._stall_timer = None

        @staticmethod
        def _cancel(timer: asyncio.TimerHandle | None) -> None:
            if timer is not None:
                timer.cancel()

    return GuardedProtocol
