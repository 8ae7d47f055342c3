"""`POST /v1/chat/completions`: parse headers and body, hand over to the serving class."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from liveloop.contracts import TURN_TYPES, TurnType, parse_turn_type
from liveloop.server.api.chat.protocol import ChatCompletionRequest, ChatCompletionResponse
from liveloop.server.api.chat.serving import RequestContext
from liveloop.server.api.chat.streaming import stream_response
from liveloop.server.api.deps import StateDep, TenantDep
from liveloop.server.api.errors import bad_request, error_responses
from liveloop.server.state import ServerState

router = APIRouter(tags=["chat"])

SESSION_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
TRUE = {"true", "1", "yes", "on"}
FALSE = {"false", "0", "no", "off"}

ERRORS = error_responses(400, 401, 403, 404, 413, 503)


def _session_id(header: str | None, request: ChatCompletionRequest) -> str | None:
    value, param = header, "X-Session-Id"
    if value is None and request.metadata:
        value, param = request.metadata.get("session_id"), "metadata.session_id"
    if value is None:
        return None
    if not SESSION_ID.match(value):
        raise bad_request(
            f"{param}: a session id is 1-128 characters of letters, digits and ._:-", param=param
        )
    return value


def _train_flag(header: str | None) -> bool:
    if header is None or header.strip().lower() in TRUE:
        return True
    if header.strip().lower() in FALSE:
        return False
    raise bad_request("X-LiveLoop-Train: must be true or false", param="X-LiveLoop-Train")


def _turn_type(header: str | None) -> TurnType:
    try:
        return parse_turn_type(header)
    except ValueError as exc:
        raise bad_request(f"X-Turn-Type: {exc}", param="X-Turn-Type") from None


HEADERS: list[dict[str, Any]] = [
    {
        "name": "X-Session-Id",
        "in": "header",
        "required": False,
        "description": "Session this turn belongs to.",
        "schema": {"type": "string", "pattern": SESSION_ID.pattern},
    },
    {
        "name": "X-Turn-Type",
        "in": "header",
        "required": False,
        "description": "'main' (default) or 'side' (never trained on).",
        "schema": {"type": "string", "enum": list(TURN_TYPES)},
    },
    {
        "name": "X-LiveLoop-Train",
        "in": "header",
        "required": False,
        "description": "'false': do not record this request at all.",
        "schema": {"type": "string", "enum": ["true", "false"]},
    },
]


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses={
        200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}},
        **ERRORS,
    },
    # Headers are read directly (documented here): FastAPI's per-parameter dependency
    # resolution was a measurable share of the server's time per request.
    openapi_extra={"parameters": HEADERS},
)
async def create_chat_completion(
    body: ChatCompletionRequest,
    request: Request,
    tenant: TenantDep,  # runs before the body is validated
    state: StateDep,
) -> Response:
    """Create a chat completion (streamed as SSE with `stream: true`)."""
    arrival = time.perf_counter()
    return await serve_chat(state, body, tenant, request.headers, arrival)


async def serve_chat(
    state: ServerState,
    body: ChatCompletionRequest,
    tenant: str,
    headers: Mapping[str, str],
    arrival: float,
) -> Response:
    """The chat completion of a validated request from an authenticated tenant.

    Called by the route above and by `ChatFastPath`, which takes well-formed requests
    around FastAPI's request machinery; `headers` are the request's (lower-case names).
    """
    ctx = RequestContext(
        tenant=tenant,
        session_id=_session_id(headers.get("x-session-id"), body),
        turn_type=_turn_type(headers.get("x-turn-type")),
        record=_train_flag(headers.get("x-liveloop-train")),
        arrival=arrival,
    )
    prep = await state.chat.prepare(body, ctx)
    if body.stream:
        return await stream_response(state.chat, prep)
    result = await state.chat.complete(prep)
    return JSONResponse(result, headers=prep.headers)
