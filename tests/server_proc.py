"""The real server as a subprocess (`python -m liveloop.cli serve ...`) for the server tests.

Test modules build their own fixture on `ServerProcess` (one server per module): it starts
the CLI on a free port against a given Valkey URL and data dir, waits for `/readyz`, and on
stop sends SIGTERM (the trace writer flushes) and collects the log for failure messages.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import redis

from liveloop.children import stop_process
from liveloop.server.api.auth import tenant_id
from liveloop.valkey import free_port
from tests.conftest import wait_until

REPO_ROOT = Path(__file__).resolve().parent.parent
API_KEYS = ("sk-test-alpha", "sk-test-beta")
ADMIN_KEY = "sk-test-admin"
RATE_KEY = "sk-test-rate-limited"  # 6 requests a minute, a burst of 2
BUSY_KEY = "sk-test-one-at-a-time"  # one request in flight at once


class ServerProcess:
    """One `liveloop serve` child process on tiny-random."""

    def __init__(
        self,
        redis_url: str,
        data_dir: Path,
        *,
        env: dict[str, str] | None = None,
        model: str = "tiny-random",
        extra_args: list[str] | None = None,
    ) -> None:
        self.redis_url = redis_url
        self.data_dir = data_dir
        self.port = free_port()
        self.model = model
        self.env = env or {}
        self.extra_args = extra_args or []
        self.log_path = data_dir / "server.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        """http://127.0.0.1:<port>"""
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The CLI invocation."""
        return [
            sys.executable, "-m", "liveloop.cli", "serve", "--model", self.model,
            "--host", "127.0.0.1", "--port", str(self.port), "--redis-url", self.redis_url,
            "--data-dir", str(self.data_dir), *self.extra_args,
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        """The child's environment: this checkout first on the path, one thread for torch."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("LIVELOOP_")}
        env.update(
            {
                "PYTHONPATH": str(REPO_ROOT),
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
                "TOKENIZERS_PARALLELISM": "false",
                "LIVELOOP_LOG_LEVEL": "INFO",
            }
        )
        if "LIVELOOP_CACHE_DIR" in os.environ:
            env["LIVELOOP_CACHE_DIR"] = os.environ["LIVELOOP_CACHE_DIR"]
        env.update(self.env)
        return env

    def start(self, timeout_s: float = 90.0) -> ServerProcess:
        """Start and wait until /readyz answers 200."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.environment()
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/readyz", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout_s}s:\n{self.log()}")

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM (graceful: the trace writer flushes), then SIGKILL; the exit status."""
        proc, self.process = self.process, None
        if proc is None:
            return None
        return stop_process(proc, timeout_s)

    def log(self) -> str:
        """The server's combined stdout/stderr so far (tail)."""
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""


def db_url(base_url: str, db: int) -> str:
    """The same Valkey server, another logical database (isolates one test module)."""
    return base_url.rsplit("/", 1)[0] + f"/{db}"


@contextlib.contextmanager
def keyed_server(valkey_url: str, db: int, workdir: Path) -> Iterator[ServerProcess]:
    """A server of its own on an emptied logical database `db`, with the API keys
    `API_KEYS` and the admin key `ADMIN_KEY`; stopped on the way out."""
    url = db_url(valkey_url, db)
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()
    env = {"LIVELOOP_API_KEYS": ",".join(API_KEYS), "LIVELOOP_ADMIN_KEY": ADMIN_KEY}
    proc = ServerProcess(url, workdir, env=env).start()
    try:
        yield proc
    finally:
        proc.stop()


def tenant_of(key: str) -> str:
    """The tenant id the server records for an API key."""
    return tenant_id(key)


def turns_of(server_redis: redis.Redis, session_id: str) -> list[dict[str, Any]]:
    """Turn records of one session, in stream order (from XRANGE liveloop:turns)."""
    entries: Any = server_redis.xrange("liveloop:turns")
    records = [json.loads(fields["data"]) for _id, fields in entries]
    return [r for r in records if r["session_id"] == session_id]


def wait_for_turns(
    server_redis: redis.Redis, session_id: str, count: int, timeout_s: float = 10.0
) -> list[dict[str, Any]]:
    """The records of a session once the trace writer wrote `count` (or all there are at the
    deadline: callers assert on them)."""
    with contextlib.suppress(AssertionError):
        wait_until(lambda: len(turns_of(server_redis, session_id)) >= count, timeout_s)
    return turns_of(server_redis, session_id)


def metric_value(text: str, name: str) -> float | None:
    """The value of an unlabelled sample in a Prometheus exposition."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def model_dir() -> Path:
    """The tiny-random model directory (for checkpoints in admin tests)."""
    from liveloop.models import resolve_model_dir

    return resolve_model_dir("tiny-random")
