"""The FastAPI app factory of the serving loop.

`create_app(settings)` builds the app; its lifespan owns everything with a life cycle: the
engine (a worker process, or a TorchEngine thread with `server.engine_process` off), the
Redis client (sessions, feedback), the trace writer
(turn records) and the weight follower (hot-swaps). Routers stay thin and reach these
through `app.state.liveloop` (a `ServerState`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from liveloop import bus
from liveloop.config import ConfigError, LiveLoopSettings
from liveloop.models import ALIASES, LoadedModel
from liveloop.server.api import admin, feedback, health, models
from liveloop.server.api.chat import api_router as chat_router
from liveloop.server.api.chat.fast_path import ChatFastPath
from liveloop.server.api.chat.serving import ChatService
from liveloop.server.api.errors import install_error_handlers
from liveloop.server.auth import Authenticator, BodySizeLimit, token_of_header
from liveloop.server.limits import TenantLimiter, TenantLimits
from liveloop.server.metrics import ServerMetrics
from liveloop.server.sessions import SessionStore

log = logging.getLogger(__name__)

REDIS_SOCKET_TIMEOUT_S = 2.0


def served_model_name(spec: str) -> str:
    """The name /v1/models lists: the alias, the hub id, or the directory / file name."""
    if spec in ALIASES:
        return spec
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        return path.stem
    if path.exists():
        return path.resolve().name
    return spec


@dataclass
class ServerState:
    """Everything the routers need, opened and closed by the app's lifespan."""

    settings: LiveLoopSettings
    auth: Authenticator
    registry: CollectorRegistry
    metrics: ServerMetrics
    preloaded: LoadedModel | None = None
    spawned: Any = None  # an EngineProcess already started by `liveloop serve`
    model_name: str = ""
    started_at: float = field(default_factory=time.time)
    capture: bool = True
    ready: bool = False
    engine: Any = None
    redis: Any = None
    sessions: Any = None
    traces: Any = None
    follower: Any = None
    chat: Any = None
    _closers: list[Any] = field(default_factory=list)

    async def open(self) -> None:
        """Connect Redis, load the model, start the engine, trace writer and weight follower."""
        from liveloop.server.tools import ChatTemplate

        cfg = self.settings.server
        if self.settings.redis_url is None:
            raise ConfigError("the server needs a Redis URL: --redis-url or LIVELOOP_REDIS_URL")
        if self.auth.open:
            log.warning("no API keys configured (LIVELOOP_API_KEYS): the server is open to anyone")
        self.capture = cfg.trace_capture
        # Short timeouts: sessions and feedback must never hang a request.
        self.redis = await bus.connect(self.settings.redis_url, timeout_s=REDIS_SOCKET_TIMEOUT_S)
        self._closers.append(self.redis.aclose)
        self.model_name = served_model_name(self.settings.model)
        tokenizer = await self._start_engine()
        await self._start_companions(self.settings.redis_url)
        self.sessions = SessionStore(self.redis, cfg.session_ttl_s)
        self.chat = self._chat_service(tokenizer, ChatTemplate(tokenizer))
        self.metrics.bind(
            running=lambda: float(self.engine.num_running),
            queued=lambda: float(self.engine.num_waiting),
            version=lambda: float(self.engine.version),
            capture=lambda: 1.0 if self.capture else 0.0,
        )
        self.ready = True
        log.info(
            "serving %s (policy v%d) on the %s engine%s",
            self.model_name,
            self.engine.version,
            self.engine.kind,
            " (worker process)" if cfg.engine == "torch" and cfg.engine_process else "",
        )

    async def _start_engine(self) -> Any:
        """Create and start the engine (`create_engine`); returns its tokenizer."""
        from liveloop.server.engine import create_engine

        engine = await create_engine(self.settings, model=self.preloaded, spawned=self.spawned)
        self.preloaded = self.spawned = None
        self.engine = engine
        self._closers.append(engine.stop)
        await engine.start()
        engine.bind_metrics(self.registry)
        return engine.tokenizer

    async def _start_companions(self, redis_url: str) -> None:
        """The trace writer (turn records) and the weight follower (hot-swaps)."""
        from liveloop.server.traces import TraceWriter, WeightFollower

        self.traces = TraceWriter(redis_url, self.settings.spool_dir, self.registry)
        await self.traces.start()
        self._closers.append(self.traces.stop)
        self.follower = WeightFollower(
            self.engine, redis_url, self.registry, follow=self.settings.server.follow_weights
        )
        await self.follower.start()
        self._closers.append(self.follower.stop)

    def _chat_service(self, tokenizer: Any, template: Any) -> ChatService:
        return ChatService(
            engine=self.engine,
            tokenizer=tokenizer,
            template=template,
            sessions=self.sessions,
            submit_turn=self.traces.submit,
            metrics=self.metrics,
            config=self.settings.server,
            model_name=self.model_name,
            model_aliases={self.settings.model},
            capture_enabled=lambda: self.capture,
        )

    async def close(self) -> None:
        """Stop everything opened, newest first (the trace writer flushes on stop)."""
        self.ready = False
        while self._closers:
            closer = self._closers.pop()
            try:
                await closer()
            except Exception:
                log.exception(
                    "error while shutting down %s", getattr(closer, "__qualname__", closer)
                )


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
            if message["type"] == "http.response.start" and self.state.engine is not None:
                headers = list(message.get("headers", []))
                headers.append((b"x-policy-version", str(self.state.engine.version).encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_version)


def create_app(
    settings: LiveLoopSettings, model: LoadedModel | None = None, engine: Any = None
) -> FastAPI:
    """The serving app; optionally with an already loaded model (thread engine) or an
    already spawned engine worker (`server.engine_process`)."""
    registry = CollectorRegistry()
    metrics = ServerMetrics(registry)
    state = ServerState(
        settings=settings,
        auth=Authenticator(settings.api_key_list, settings.admin_key),
        registry=registry,
        metrics=metrics,
        preloaded=model,
        spawned=engine,
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
    app.add_middleware(BodySizeLimit, max_bytes=settings.server.max_body_bytes)
    app.add_middleware(  # outermost: a request over its key's limits is refused first
        TenantLimits,
        limiter=TenantLimiter(settings.server.limits, settings.server.key_limits),
        tenant_of=lambda header: state.auth.find(token_of_header(header)),
        on_limit=lambda reason: metrics.limited.labels(reason).inc(),
    )
    for router in (chat_router.router, models.router, feedback.router, admin.router, health.router):
        app.include_router(router)
    return app
