"""OpenAI-shaped errors: every failure leaves the server as `{"error": {...}}` with a status.

Agents and the official client parse this shape; a 4xx names the problem and the offending
parameter, a 5xx is a bug (logged with its traceback, counted by type in the metrics).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class ErrorDetail(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every 4xx/5xx."""

    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` of a route: these statuses answer an `ErrorResponse`."""
    return {status: {"model": ErrorResponse} for status in statuses}


class APIError(Exception):
    """An error answered to the client in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or ERROR_TYPES.get(status, "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body: `{"error": {"message", "type", "param", "code"}}`."""
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        """A JSON response carrying this error."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 invalid_request_error."""
    return APIError(400, message, param=param, code=code)


UNION_TAGS = frozenset(
    {"str", "int", "float", "bool", "none", "system", "developer", "user", "assistant", "tool"}
    | {"text", "json_object", "json_schema"}
)


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    """A client-facing parameter path: the union branch tags pydantic adds are dropped."""
    parts: list[str] = []
    for i, part in enumerate(loc):
        text = str(part)
        before = loc[i - 1] if i else None
        tag_position = isinstance(before, int) or before in ("response_format", "tool_choice")
        if (i == 0 and text == "body") or "[" in text or text[:1].isupper():
            continue
        if text in UNION_TAGS and tag_position:
            continue
        parts.append(text)
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> APIError:
    """The most specific validation problem as a 400 naming the parameter."""
    errors = list(exc.errors())
    if not errors:
        return bad_request("invalid request")
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    if any(e.get("type") == "json_invalid" for e in errors):
        return bad_request("request body is not valid JSON")
    param = _loc_to_param(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") == "missing":
        msg = "required parameter is missing"
    elif first.get("type") == "model_attributes_type" and param is None:
        msg = "request body must be a JSON object"
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    where = f"{param}: " if param else ""
    return bad_request(f"{where}{msg}{more}", param=param, code="invalid_value")


def install_error_handlers(app: FastAPI, on_error: Callable[[str], None] | None = None) -> None:
    """Map validation errors, HTTP errors and unexpected exceptions to OpenAI's shape."""

    def count(kind: str) -> None:
        if on_error is not None:
            on_error(kind)

    async def api_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        count(exc.code or exc.type)
        return exc.response()

    async def invalid(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        count("invalid_request")
        return validation_error(exc).response()

    async def http_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        count(f"http_{exc.status_code}")
        kind = ERROR_TYPES.get(exc.status_code, "invalid_request_error")
        body = error_body(str(exc.detail), kind)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        count("internal_error")
        body = error_body(f"internal server error: {type(exc).__name__}", "server_error")
        return JSONResponse(body, status_code=500)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
