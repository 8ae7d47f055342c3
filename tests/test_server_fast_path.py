"""ChatFastPath as an ASGI middleware on its own: which requests it serves, which it hands on.

The served path itself (`serve_chat`) runs in every chat test against the real server; here
it is replaced by a recorder so the routing decision can be seen. The app behind the
middleware records what it receives, so a request handed on is checked byte for byte.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from liveloop.server.api.auth import Authenticator
from liveloop.server.api.chat import fast_path
from liveloop.server.api.chat.fast_path import ChatFastPath
from liveloop.server.api.errors import APIError

KEY = "sk-fast-path"
BODY = {"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}]}
JSON = json.dumps(BODY).encode()


class RecordingApp:
    """The app behind the middleware: remembers the body it read, answers 299."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        self.bodies.append(body)
        await Response(status_code=299)(scope, receive, send)


def scope_for(headers: dict[str, str], path: str = "/v1/chat/completions") -> Scope:
    return {
        "type": "http", "method": "POST", "path": path, "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }  # fmt: skip


async def call(
    middleware: ChatFastPath, scope: Scope, chunks: list[bytes]
) -> tuple[int, dict[str, Any] | None]:
    """Send the body in `chunks`; the status and JSON body of the answer."""
    incoming: list[Message] = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    sent: list[Message] = []

    async def receive() -> Message:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    await middleware(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body) if body else None


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """serve_chat replaced by a recorder (the real one needs the engine: see module doc)."""
    calls: list[tuple[Any, ...]] = []

    async def recorder(
        state: Any, body: Any, tenant: str, headers: Any, arrival: float
    ) -> Response:
        calls.append((body, tenant, headers.get("x-session-id")))
        if body.model == "missing":
            raise APIError(404, "no such model", param="model", code="model_not_found")
        return JSONResponse({"served": True})

    monkeypatch.setattr(fast_path, "serve_chat", recorder)
    return calls


def middleware(ready: bool = True) -> tuple[ChatFastPath, RecordingApp, list[str]]:
    app, errors = RecordingApp(), []
    state: Any = SimpleNamespace(ready=ready, auth=Authenticator([KEY], None))
    return ChatFastPath(app, state=state, on_error=errors.append), app, errors


HEADERS = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}


async def test_a_valid_request_is_served_by_the_chat_handler_in_chunks_too(
    served: list[tuple[Any, ...]],
) -> None:
    fast, app, _ = middleware()
    status, body = await call(
        fast, scope_for({**HEADERS, "X-Session-Id": "s-1"}), [JSON[:10], JSON[10:]]
    )
    assert (status, body) == (200, {"served": True})
    assert app.bodies == []
    request, tenant, session = served[0]
    assert request.messages[0].content == "hi"
    assert tenant == Authenticator([KEY], None).tenant(KEY)
    assert session == "s-1"


@pytest.mark.parametrize(
    ("headers", "raw", "ready"),
    [
        pytest.param(HEADERS, b'{"model": "tiny-random", "messages": [', True, id="bad-json"),
        pytest.param(HEADERS, json.dumps({**BODY, "top_p": 9}).encode(), True, id="invalid"),
        pytest.param(HEADERS, json.dumps({**BODY, "messages": []}).encode(), True, id="empty"),
        pytest.param(HEADERS, b"[1, 2]", True, id="not-an-object"),
        pytest.param({**HEADERS, "authorization": "Bearer sk-no"}, JSON, True, id="wrong-key"),
        pytest.param({"content-type": "application/json"}, JSON, True, id="no-key"),
        pytest.param({**HEADERS, "content-type": "text/plain"}, JSON, True, id="text-plain"),
        pytest.param(HEADERS, JSON, False, id="not-ready"),
    ],
)
async def test_anything_else_reaches_the_app_with_the_same_body(
    served: list[tuple[Any, ...]], headers: dict[str, str], raw: bytes, ready: bool
) -> None:
    fast, app, _ = middleware(ready)
    status, _ = await call(fast, scope_for(headers), [raw[:7], raw[7:]])
    assert status == 299
    assert app.bodies == [raw]
    assert served == []


async def test_other_routes_and_methods_are_not_read_at_all(
    served: list[tuple[Any, ...]],
) -> None:
    fast, app, _ = middleware()
    status, _ = await call(fast, scope_for(HEADERS, path="/v1/feedback"), [JSON])
    get = {**scope_for(HEADERS), "method": "GET"}
    status_get, _ = await call(fast, get, [b""])
    assert (status, status_get) == (299, 299)
    assert app.bodies == [JSON, b""]
    assert served == []


async def test_an_error_of_the_handler_is_answered_in_openai_shape_and_counted(
    served: list[tuple[Any, ...]],
) -> None:
    fast, app, errors = middleware()
    raw = json.dumps({**BODY, "model": "missing"}).encode()
    status, body = await call(fast, scope_for(HEADERS), [raw])
    assert status == 404
    assert body == {
        "error": {
            "message": "no such model", "type": "not_found_error",
            "param": "model", "code": "model_not_found",
        }
    }  # fmt: skip
    assert errors == ["model_not_found"]
    assert app.bodies == []
