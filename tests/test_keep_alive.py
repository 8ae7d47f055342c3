"""Idle keep-alive connections on the real server: kept longer than clients keep theirs.

httpx (and so the OpenAI SDK) drops an idle pooled connection after 5 s, uvicorn's default
server-side timeout is also 5 s, and a server that closes first can reset a request sent on
the connection at that moment. The server keeps idle connections for
`server.keep_alive_timeout_s` (75 s by default).
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

from liveloop.valkey import EmbeddedValkey
from tests.server_proc import ServerProcess, db_url

pytest_plugins = ["tests.server_fixtures"]

REQUEST = b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n"


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _response(sock: socket.socket) -> bytes:
    """One response's head and body (a short JSON body with content-length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )  # fmt: skip
    while len(body) < length:
        body += sock.recv(4096)
    return head


def test_an_idle_connection_outlives_the_clients_pool_timeout(
    liveloop_server: ServerProcess,
) -> None:
    with _connect(liveloop_server.base_url) as sock:
        sock.sendall(REQUEST)
        assert _response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(6.5)  # idle past httpx's 5 s and uvicorn's default
        sock.sendall(REQUEST)  # the same connection, still open
        assert _response(sock).startswith(b"HTTP/1.1 200")


def test_the_keep_alive_timeout_is_a_setting(valkey_server: EmbeddedValkey, tmp_path: Path) -> None:
    env = {"LIVELOOP_SERVER__KEEP_ALIVE_TIMEOUT_S": "1"}
    server = ServerProcess(db_url(valkey_server.url, 13), tmp_path, env=env).start()
    try:
        with _connect(server.base_url) as sock:
            sock.sendall(REQUEST)
            assert _response(sock).startswith(b"HTTP/1.1 200")
            started = time.monotonic()
            assert sock.recv(1) == b""  # closed by the server once idle for 1 s
            assert 0.5 < time.monotonic() - started < 5
    finally:
        server.stop()
