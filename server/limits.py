"""Per-key request rate and concurrency limits on the API routes.

Why: one tenant (a runaway agent, a leaked key) must not take every engine slot from the
others. Each caller's tenant (its API key id) gets a token bucket of `requests_per_minute`
(with a burst) and a cap on requests in flight at once, streams counted until they end; a
request over either gets 429 in OpenAI's error shape with `Retry-After`. Limits come from
`server.limits` and, per key, from `server.key_limits` (by key id, never the key itself).
A request whose key does not authenticate passes through untouched: the route answers
401. Limits are per server process; replicas behind a router each apply them.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from liveloop.config.server import KeyLimits
from liveloop.server.api.errors import error_body

LIMITED_PATHS = frozenset({"/v1/chat/completions", "/v1/feedback"})


@dataclass
class _Bucket:
    tokens: float
    updated: float
    in_flight: int = 0


class TenantLimiter:
    """Token buckets and in-flight counts by tenant."""

    def __init__(self, default: KeyLimits, per_key: dict[str, KeyLimits]) -> None:
        self.default = default
        self.per_key = per_key
        self._buckets: dict[str, _Bucket] = {}

    def limits(self, tenant: str) -> KeyLimits:
        """The limits that apply to a tenant."""
        return self.per_key.get(tenant, self.default)

    def acquire(self, tenant: str, now: float | None = None) -> tuple[str, float] | None:
        """Take one request for `tenant`; None if allowed, else (reason, retry after s)."""
        now = time.monotonic() if now is None else now
        lim = self.limits(tenant)
        burst = float(lim.effective_burst)
        bucket = self._buckets.setdefault(tenant, _Bucket(burst, now))
        if lim.concurrent_requests and bucket.in_flight >= lim.concurrent_requests:
            return "concurrency", 1.0
        if lim.requests_per_minute:
            rate = lim.requests_per_minute / 60.0
            bucket.tokens = min(burst, bucket.tokens + (now - bucket.updated) * rate)
            bucket.updated = now
            if bucket.tokens < 1.0:
                return "rate", (1.0 - bucket.tokens) / rate
            bucket.tokens -= 1.0
        bucket.in_flight += 1
        return None

    def release(self, tenant: str) -> None:
        """A request of `tenant` has ended."""
        bucket = self._buckets.get(tenant)
        if bucket is not None and bucket.in_flight > 0:
            bucket.in_flight -= 1


class TenantLimits:
    """ASGI middleware applying `TenantLimiter` to the API routes."""

    def __init__(
        self,
        app: ASGIApp,
        limiter: TenantLimiter,
        tenant_of: Callable[[str | None], str | None],
        on_limit: Callable[[str], None],
    ) -> None:
        self.app = app
        self.limiter = limiter
        self.tenant_of = tenant_of  # Authorization header -> tenant, None if it fails
        self.on_limit = on_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in LIMITED_PATHS:
            await self.app(scope, receive, send)
            return
        authorization = None
        for name, value in scope.get("headers") or []:
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        tenant = self.tenant_of(authorization)
        if tenant is None:  # unauthenticated: the route answers 401
            await self.app(scope, receive, send)
            return
        refused = self.limiter.acquire(tenant)
        if refused is not None:
            reason, retry_after = refused
            self.on_limit(reason)
            await self._reject(send, tenant, reason, retry_after)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.limiter.release(tenant)

    async def _reject(self, send: Send, tenant: str, reason: str, retry_after: float) -> None:
        lim = self.limiter.limits(tenant)
        if reason == "rate":
            message = f"rate limit reached: {lim.requests_per_minute} requests per minute"
            code = "rate_limit_exceeded"
        else:
            message = f"too many requests at once: at most {lim.concurrent_requests} in flight"
            code = "concurrency_limit_exceeded"
        body = json.dumps(error_body(message, "rate_limit_error", code=code)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(max(1, math.ceil(retry_after))).encode()),
        ]
        await send({"type": "http.response.start", "status": 429, "headers": headers})
        await send({"type": "http.response.body", "body": body})
