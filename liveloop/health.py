"""The small HTTP endpoint of a loop without an API of its own: /metrics, /healthz, /readyz.

`liveloop judge`, `collect` and `train` have no HTTP API, yet orchestrators need to know
whether they live and whether they work, and Prometheus needs their metrics. One port
serves all three:

- `/healthz`: 200 while the process runs (its HTTP thread answers);
- `/readyz`: 200 once the loop said it started (`mark_ready`) and, when a Redis URL is
  given, Redis answers a PING within a second; 503 with the reason otherwise;
- anything else: the Prometheus exposition of the loop's registry (as before).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import redis
from prometheus_client import CollectorRegistry, make_wsgi_app

log = logging.getLogger(__name__)

StartResponse = Callable[..., Any]


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    """One thread per request (a slow scrape never blocks a probe); threads die with us."""

    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    """No access log line per probe or scrape."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class LoopHealth:
    """Health, readiness and metrics of one loop process, served from a daemon thread."""

    def __init__(self, registry: CollectorRegistry, redis_url: str | None = None) -> None:
        self.registry = registry
        self.redis_url = redis_url
        self._ready = threading.Event()
        self._metrics_app = make_wsgi_app(registry)
        self._server: WSGIServer | None = None
        self._redis: redis.Redis | None = None

    def mark_ready(self) -> None:
        """The loop runs: /readyz may answer 200 (while Redis answers too)."""
        self._ready.set()

    def mark_stopping(self) -> None:
        """The loop is stopping: /readyz answers 503 from now on."""
        self._ready.clear()

    def readiness(self) -> tuple[bool, str]:
        """(ready, reason) as /readyz reports it."""
        if not self._ready.is_set():
            return False, "starting"
        if self.redis_url is None:
            return True, "ready"
        try:
            if self._redis is None:
                self._redis = redis.from_url(
                    self.redis_url, socket_timeout=1.0, socket_connect_timeout=1.0
                )
            self._redis.ping()
        except (redis.RedisError, OSError) as exc:
            return False, f"redis unreachable: {exc}"
        return True, "ready"

    def app(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        """The WSGI application: the two probes, else the metrics exposition."""
        path = environ.get("PATH_INFO", "/")
        if path == "/healthz":
            return _json(start_response, 200, {"status": "ok"})
        if path == "/readyz":
            ready, reason = self.readiness()
            return _json(start_response, 200 if ready else 503, {"status": reason})
        return self._metrics_app(environ, start_response)  # type: ignore[no-any-return]

    def start(self, port: int, host: str = "0.0.0.0") -> LoopHealth:
        """Listen on host:port in a daemon thread; OSError if the port is taken."""
        self._server = make_server(
            host, port, self.app, server_class=_ThreadingServer, handler_class=_QuietHandler
        )
        threading.Thread(target=self._server.serve_forever, name="health", daemon=True).start()
        log.info("metrics and probes on http://%s:%d (/metrics, /healthz, /readyz)", host, port)
        return self

    def stop(self) -> None:
        """Stop listening and close the Redis connection."""
        self.mark_stopping()
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._redis is not None:
            self._redis.close()


def _json(start_response: StartResponse, status: int, body: dict[str, str]) -> list[bytes]:
    payload = json.dumps(body).encode()
    reason = {200: "OK", 503: "Service Unavailable"}[status]
    headers = [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))]
    start_response(f"{status} {reason}", headers)
    return [payload]
