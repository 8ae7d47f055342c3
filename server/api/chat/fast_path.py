"""A short way in for well-formed chat requests: the same handler, without FastAPI's machinery.

Why: before a request reaches the engine, the server spends much of its time in Starlette's
routing and FastAPI's request handling (request object, body reading, dependency solving,
the exception wrapper around every streamed chunk). On a small box that time is added to
the time to first token and taken from the engine (bench/gateway.py). This ASGI
middleware takes `POST /v1/chat/completions` requests with a JSON body that validates and
a key that authenticates, and calls `serve_chat`, exactly what the route calls.

Everything else goes to the app unchanged, with the body replayed: a bad key, a body that
does not parse or validate, another content type, a server that is not ready. So every
error is still FastAPI's own answer, and the route stays in the OpenAPI schema. Request
handling belongs in `serve_chat` (headers included); a dependency added to the route alone
would be skipped here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from liveloop.server.api.auth import replay, token_of_header
from liveloop.server.api.chat.api_router import serve_chat
from liveloop.server.api.chat.protocol import ChatCompletionRequest
from liveloop.server.api.errors import APIError
from liveloop.server.state import ServerState

PATH = "/v1/chat/completions"


class ChatFastPath:
    """ASGI middleware: valid chat completion requests skip routing and FastAPI's handler."""

    def __init__(self, app: ASGIApp, state: ServerState, on_error: Callable[[str], None]) -> None:
        self.app = app
        self.state = state
        self.on_error = on_error  # counts an error answered here, as the app's handler does

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != PATH:
            await self.app(scope, receive, send)
            return
        arrival = time.perf_counter()
        messages = await read_request(receive)
        headers = Headers(scope=scope)
        accepted = self._accept(headers, messages)
        if accepted is None:
            await self.app(scope, replay(messages, receive), send)
            return
        body, tenant = accepted
        try:
            response = await serve_chat(self.state, body, tenant, headers, arrival)
        except APIError as exc:
            self.on_error(exc.code or exc.type)
            response = exc.response()
        await response(scope, receive, send)

    def _accept(
        self, headers: Headers, messages: list[Message]
    ) -> tuple[ChatCompletionRequest, str] | None:
        """The validated body and the caller's tenant, or None to let the app answer."""
        if not self.state.ready or messages[-1]["type"] != "http.request":
            return None
        media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            return None
        try:
            tenant = self.state.auth.tenant(token_of_header(headers.get("authorization")))
            data: Any = json.loads(b"".join(m.get("body", b"") for m in messages))
            return ChatCompletionRequest.model_validate(data), tenant
        except Exception:  # a bad key or body: the app answers it, exactly as without this
            return None


async def read_request(receive: Receive) -> list[Message]:
    """Every message of the request body (the last one may be a disconnect)."""
    messages = [await receive()]
    while messages[-1]["type"] == "http.request" and messages[-1].get("more_body", False):
        messages.append(await receive())
    return messages
