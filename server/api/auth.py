"""Authentication, tenancy and the request body size limit.

API keys (`LIVELOOP_API_KEYS`) are checked as Bearer tokens; the tenant recorded with each
turn is a stable hash of the key (`tenant_id`), never the key. Without keys
the server is open and every caller is the tenant "anonymous". `/admin/*` needs the
separate admin key; without one the admin API is off. Bodies over the limit get a 413
before any route parses them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging

from fastapi import Request
from fastapi.security import HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from liveloop.server.api.errors import APIError, error_body
from liveloop.tenants import tenant_id

log = logging.getLogger(__name__)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Authenticator:
    """Maps Bearer tokens to tenants and guards the admin routes."""

    def __init__(self, api_keys: list[str], admin_key: str | None) -> None:
        self._tenants = {_digest(k): tenant_id(k) for k in api_keys}
        self._admin = _digest(admin_key) if admin_key else None

    @property
    def tenants(self) -> frozenset[str]:
        """The tenant ids of the configured API keys."""
        return frozenset(self._tenants.values())

    @property
    def open(self) -> bool:
        """True when no API keys are configured (anyone may call, as 'anonymous')."""
        return not self._tenants

    def tenant(self, token: str | None) -> str:
        """The tenant of a Bearer token; raises a 401 APIError for a missing or wrong key."""
        if self.open:
            return tenant_id(None)
        if not token:
            raise APIError(
                401,
                "missing API key: send it as 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        tenant = self.find(token)
        if tenant is None:
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")
        return tenant

    def find(self, token: str | None) -> str | None:
        """The tenant of a token, or None; 'anonymous' when the server is open.

        Every known key's digest is compared, in constant time, whichever matches: the
        time taken says nothing about the key or which one it is.
        """
        if self.open:
            return tenant_id(None)
        if not token:
            return None
        digest = _digest(token)
        found = None
        for known, tenant in self._tenants.items():
            if hmac.compare_digest(known, digest):
                found = tenant
        return found

    def check_admin(self, token: str | None) -> None:
        """Raise unless the token is the admin key (403 when the admin API is off)."""
        if self._admin is None:
            raise APIError(
                403, "the admin API is disabled: set LIVELOOP_ADMIN_KEY", code="admin_disabled"
            )
        if not token or not hmac.compare_digest(self._admin, _digest(token)):
            raise APIError(401, "admin routes need the admin key", code="invalid_api_key")


def bearer_token(request: Request) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, parsed as HTTPBearer does."""
    return token_of_header(request.headers.get("authorization"))


def token_of_header(authorization: str | None) -> str | None:
    """The token of an `Authorization` header value if it is `Bearer <token>`."""
    scheme, token = get_authorization_scheme_param(authorization)
    return token if scheme.lower() == "bearer" and token else None


def authenticator(request: Request) -> Authenticator:
    """The running server's authenticator."""
    auth: Authenticator = request.app.state.liveloop.auth
    return auth


class TenantAuth(HTTPBearer):
    """The one tenant dependency: the caller's tenant, 401 on a missing or wrong key.

    A security scheme, so the OpenAPI schema documents the Bearer token; it reads the header
    itself (no sub-dependency: FastAPI's per-parameter resolution was a measurable share of
    the server's time per request, see bench/gateway.py).
    """

    async def __call__(self, request: Request) -> str:  # type: ignore[override]
        return authenticator(request).tenant(bearer_token(request))


class AdminAuth(HTTPBearer):
    """The admin dependency: the caller must hold the admin key (403 when admin is off)."""

    async def __call__(self, request: Request) -> None:  # type: ignore[override]
        authenticator(request).check_admin(bearer_token(request))


DESCRIPTION = "An API key from LIVELOOP_API_KEYS (the admin key for /admin)."
tenant_auth = TenantAuth(auto_error=False, scheme_name="HTTPBearer", description=DESCRIPTION)
admin_auth = AdminAuth(auto_error=False, scheme_name="HTTPBearer", description=DESCRIPTION)


class BodySizeLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 in OpenAI's error shape.

    The declared Content-Length is checked first; a body sent without one is buffered up
    to the limit and replayed to the app.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > self.max_bytes
            except ValueError:
                too_big = False
            if too_big:
                await self._reject(send)
                return
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._reject(send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, replay(messages, receive), send)

    async def _reject(self, send: Send) -> None:
        body = json.dumps(
            error_body(
                f"request body larger than the limit of {self.max_bytes} bytes",
                "invalid_request_error",
                code="request_too_large",
            )
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def replay(messages: list[Message], receive: Receive) -> Receive:
    """A `receive` that hands out already read messages first, then reads on."""
    pending = list(messages)

    async def next_message() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return next_message
