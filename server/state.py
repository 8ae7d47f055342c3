"""The serving loop's state: what the routes need, opened and closed by the app's lifespan.

`ServerState.open()` connects Redis, starts the engine (`create_engine`: the torch engine
in a worker process or a thread, or the SGLang gateway), the trace writer (turn records)
and the weight follower (hot-swaps); `close()` stops them, newest first. Routes reach it through the
`StateDep` dependency (`liveloop.server.api.deps`), which answers 503 until it is ready;
its parts that exist only once started are properties that say so when read too early.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import redis.asyncio as aredis
from prometheus_client import CollectorRegistry

from liveloop import bus
from liveloop.config import ConfigError, ServerConfig, SharedSettings
from liveloop.models import ALIASES, LoadedModel
from liveloop.server.api.auth import Authenticator
from liveloop.server.api.chat.serving import ChatService
from liveloop.server.metrics import ServerMetrics
from liveloop.server.sessions import SessionStore
from liveloop.server.traces import TraceWriter, WeightFollower

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from liveloop.server.engine import EngineClient
    from liveloop.server.tools import ChatTemplate

T = TypeVar("T")

log = logging.getLogger(__name__)

REDIS_SOCKET_TIMEOUT_S = 2.0  # sessions and feedback must never hang a request


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


class NotStarted(RuntimeError):
    """A part of the server state was read before the lifespan started it."""


@dataclass
class ServerState:
    """Everything the routes need; the parts with a life cycle are started by `open()`."""

    shared: SharedSettings
    config: ServerConfig
    auth: Authenticator
    registry: CollectorRegistry
    metrics: ServerMetrics
    preloaded: LoadedModel | None = None  # a model loaded before the app (thread engine)
    spawned: EngineClient | None = None  # an engine started by `liveloop serve`
    model_name: str = ""
    started_at: float = field(default_factory=time.time)
    capture: bool = True
    archive_dir: Path | None = None  # the stream archive (a deleted tenant's records go)
    ready: bool = False
    _engine: EngineClient | None = None
    _redis: aredis.Redis | None = None
    _sessions: SessionStore | None = None
    _traces: TraceWriter | None = None
    _follower: WeightFollower | None = None
    _chat: ChatService | None = None
    _closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    # The started parts -----------------------------------------------------------------
    @property
    def has_engine(self) -> bool:
        """True once the engine exists (it may still be starting)."""
        return self._engine is not None

    @property
    def engine(self) -> EngineClient:
        """The generation engine."""
        if self._engine is None:
            raise NotStarted("the server's engine has not started")
        return self._engine

    @property
    def redis(self) -> aredis.Redis:
        """The Redis client of sessions and feedback (short timeouts)."""
        return _started(self._redis, "Redis client")

    @property
    def sessions(self) -> SessionStore:
        """Session resolution and turn bookkeeping."""
        return _started(self._sessions, "session store")

    @property
    def traces(self) -> TraceWriter:
        """The turn-record writer."""
        return _started(self._traces, "trace writer")

    @property
    def follower(self) -> WeightFollower:
        """The weight follower (hot-swaps, admin loads)."""
        return _started(self._follower, "weight follower")

    @property
    def chat(self) -> ChatService:
        """The chat completions service."""
        return _started(self._chat, "chat service")

    def _template(self, tokenizer: PreTrainedTokenizerBase) -> ChatTemplate:
        """The chat template, its tool-result reminder checked (ConfigError if it cannot)."""
        from liveloop.server.tools import ChatTemplate as Template

        template = Template(tokenizer, self.shared.effective_tool_result_reminder)
        try:
            template.check_reminder()
        except ValueError as exc:
            raise ConfigError(
                f"tool_result_reminder: {exc}; set LIVELOOP_TOOL_RESULT_REMINDER='' (or "
                '`tool_result_reminder = ""` in the settings file) to serve without it'
            ) from None
        return template

    # Life cycle ------------------------------------------------------------------------
    async def open(self) -> None:
        """Connect Redis, load the model, start the engine, trace writer and weight follower."""
        redis_url = self.shared.require_redis("serve")
        if self.auth.open:
            log.warning("no API keys configured (LIVELOOP_API_KEYS): the server is open to anyone")
        self.capture = self.config.trace_capture
        self._redis = await bus.connect(redis_url, timeout_s=REDIS_SOCKET_TIMEOUT_S)
        self._closers.append(self._redis.aclose)
        self.model_name = served_model_name(self.shared.model)
        tokenizer = await self._start_engine()
        await self._start_companions(redis_url)
        self._sessions = SessionStore(self.redis, self.config.session_ttl_s)
        self._chat = self._chat_service(tokenizer, self._template(tokenizer))
        engine = self.engine
        self.metrics.bind(
            running=lambda: float(engine.num_running),
            queued=lambda: float(engine.num_waiting),
            version=lambda: float(engine.version),
            capture=lambda: 1.0 if self.capture else 0.0,
        )
        self.ready = True
        cfg = self.config
        log.info(
            "serving %s (policy v%d) on the %s engine%s",
            self.model_name,
            engine.version,
            engine.kind,
            " (worker process)" if cfg.engine == "torch" and cfg.engine_process else "",
        )

    async def _start_engine(self) -> PreTrainedTokenizerBase:
        """Create and start the engine (`create_engine`); returns its tokenizer."""
        from liveloop.server.engine import create_engine

        engine = await create_engine(
            self.shared, self.config, model=self.preloaded, spawned=self.spawned
        )
        self.preloaded = self.spawned = None
        self._engine = engine
        self._closers.append(engine.stop)
        await engine.start()
        engine.bind_metrics(self.registry)
        tokenizer: PreTrainedTokenizerBase = engine.tokenizer
        return tokenizer

    async def _start_companions(self, redis_url: str) -> None:
        """The trace writer (turn records) and the weight follower (hot-swaps)."""
        self._traces = TraceWriter(redis_url, self.shared.spool_dir, self.registry)
        await self._traces.start()
        self._closers.append(self._traces.stop)
        self._follower = WeightFollower(
            self.engine, redis_url, self.registry, follow=self.config.follow_weights
        )
        await self._follower.start()
        self._closers.append(self._follower.stop)

    def _chat_service(
        self, tokenizer: PreTrainedTokenizerBase, template: ChatTemplate
    ) -> ChatService:
        return ChatService(
            engine=self.engine,
            tokenizer=tokenizer,
            template=template,
            sessions=self.sessions,
            submit_turn=self.traces.submit,
            metrics=self.metrics,
            config=self.config,
            model_name=self.model_name,
            model_aliases={self.shared.model},
            capture_enabled=lambda: self.capture,
            adapters=self.follower.routing,
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


def _started(part: T | None, what: str) -> T:
    if part is None:
        raise NotStarted(f"the server's {what} has not started")
    return part
