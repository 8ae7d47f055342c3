"""`liveloop serve`: run the serving app under uvicorn.

Everything that can fail because of the user's environment is checked before uvicorn
starts, so it ends as one line and a non-zero exit (through the CLI): the port is taken,
Redis is unreachable, the model cannot be loaded.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path
from typing import Any

import uvicorn

from liveloop.bus import connect_sync
from liveloop.config import AuthSettings, ConfigError, ServerConfig, SharedSettings
from liveloop.models import load_model, resolve_model_dir

log = logging.getLogger(__name__)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port; OSError with a one-line reason if taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP: asyncio only sets TCP_NODELAY on accepted sockets of that proto;
    # without it every response waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def _engine_or_model(shared: SharedSettings, cfg: ServerConfig) -> dict[str, Any]:
    """The started engine worker (or, in-thread, the loaded model) for create_app."""
    if cfg.engine == "sglang":
        return {}  # the gateway reaches (or launches) its servers in the app's lifespan
    if not cfg.engine_process:
        return {"model": load_model(shared.model, cfg.device)}
    from liveloop.server.engine.process import EngineOptions, EngineProcess

    engine = EngineProcess(EngineOptions.from_config(shared.model, cfg))
    engine.spawn()  # a model that cannot load ends start-up here, with its reason
    return {"engine": engine}


def check_sglang_urls(urls: list[str], timeout_s: float = 5.0) -> None:
    """ConnectionError (one line) when none of the SGLang servers answers `/health`."""
    import httpx

    for url in urls:
        try:
            if httpx.get(url.rstrip("/") + "/health", timeout=timeout_s).status_code == 200:
                return
        except httpx.HTTPError:
            continue
    raise ConnectionError(f"no SGLang server answered at {', '.join(urls)}")


def _protocol(cfg: ServerConfig, app: Any) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol with the server's connection limits (see http_guard)."""
    from liveloop.server.http_guard import guarded_protocol

    closed = app.state.liveloop.metrics.connections_closed
    return guarded_protocol(
        max_header_bytes=cfg.max_header_bytes,
        read_timeout_s=cfg.request_read_timeout_s,
        write_stall_timeout_s=cfg.write_stall_timeout_s,
        on_close=lambda reason: closed.labels(reason).inc(),
    )


def run(
    shared: SharedSettings,
    cfg: ServerConfig,
    auth: AuthSettings,
    *,
    archive_dir: Path | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM; raises ConfigError/BusUnavailable/ModelLoadError/OSError.

    `archive_dir`: the stream archive, from which a deleted tenant's records are removed."""
    redis_url = shared.require_redis("serve")
    sglang = cfg.sglang
    if cfg.engine == "sglang" and not sglang.urls and not sglang.launch:
        raise ConfigError(
            "server.engine 'sglang' needs SGLang servers: --sglang-url URL[,URL...] "
            "or --launch N (server.sglang.urls / server.sglang.launch)"
        )
    sock = bind_socket(shared.host, shared.port)
    try:
        connect_sync(redis_url).close()
        resolve_model_dir(shared.model)  # fails fast, before any engine starts
        if cfg.engine == "sglang" and not sglang.launch:
            check_sglang_urls(sglang.urls)
        from liveloop.server.app import create_app

        app = create_app(
            shared, cfg, auth, archive_dir=archive_dir, **_engine_or_model(shared, cfg)
        )
        config = uvicorn.Config(
            app,
            http=_protocol(cfg, app),
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_keep_alive=cfg.keep_alive_timeout_s,
            timeout_graceful_shutdown=5,
        )
        server = uvicorn.Server(config)
        host, port = sock.getsockname()[:2]
        log.info("listening on http://%s:%d", host, port)
        server.run(sockets=[sock])
    finally:
        sock.close()
    if not server.started:
        raise RuntimeError("the server failed to start (see the log above)")
