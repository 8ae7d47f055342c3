"""The FastAPI app factory of the serving loop.

`create_app(shared, config, auth)` builds the app; its lifespan opens and closes the
`ServerState` (`liveloop.server.state`: the engine, the Redis client, the trace writer and
the weight follower). Routers stay thin and reach the state through the dependencies of
`liveloop.server.api.deps`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from liveloop.config import AuthSettings, ServerConfig, SharedSettings
from liveloop.models import LoadedModel
from liveloop.server.api import admin, feedback, health, models
from liveloop.server.api.auth import Authenticator, BodySizeLimit, token_of_header
from liveloop.server.api.chat import api_router as chat_router
from liveloop.server.api.chat.fast_path import ChatFastPath
from liveloop.server.api.errors import install_error_handlers
from liveloop.server.engine import EngineClient
from liveloop.server.limits import TenantLimiter, TenantLimits
from liveloop.server.metrics import ServerMetrics
from liveloop.server.state import ServerState


class PolicyVersionHeader:
    """ASGI middleware: every response carries `X-Policy-Version` once the engine runs."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_version(message: Message) -> None:
            if message["type"] == "http.response.start" and self.state.has_engine:
                headers = list(message.get("headers", []))
                if not any(name.lower() == b"x-policy-version" for name, _v in headers):
                    version = str(self.state.engine.version).encode()
                    headers.append((b"x-policy-version", version))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_version)


def create_app(
    shared: SharedSettings,
    config: ServerConfig,
    auth: AuthSettings,
    model: LoadedModel | None = None,
    engine: EngineClient | None = None,
    archive_dir: Path | None = None,
) -> FastAPI:
    """The serving app; optionally with an already loaded model (thread engine) or an
    already started engine (the torch worker `liveloop serve` spawned)."""
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry)
    state = ServerState(
        shared=shared,
        config=config,
        auth=Authenticator(auth.api_keys, auth.admin_key),
        registry=registry,
        metrics=metrics,
        preloaded=model,
        spawned=engine,
        archive_dir=archive_dir,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        try:
            await state.open()
            yield
        finally:
            await state.close()

    app = FastAPI(
        title="LiveLoop",
        description="OpenAI-compatible chat serving that records every turn token-exactly.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.liveloop = state
    install_error_handlers(app, metrics.error)
    app.add_middleware(ChatFastPath, state=state, on_error=metrics.error)  # innermost
    app.add_middleware(PolicyVersionHeader, state=state)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(  # outermost: a request over its key's limits is refused first
        TenantLimits,
        limiter=TenantLimiter(config.limits, config.key_limits),
        tenant_of=lambda header: state.auth.find(token_of_header(header)),
        on_limit=lambda reason: metrics.limited.labels(reason).inc(),
    )
    for router in (chat_router.router, models.router, feedback.router, admin.router, health.router):
        app.include_router(router)
    return app
