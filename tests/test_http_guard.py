"""Connection limits on a real uvicorn server: silent, slow, oversized and non-reading clients.

A small ASGI app stands in for LiveLoop's (the limits live in the HTTP protocol, below any
app): it answers a short JSON body, echoes request bodies, or streams 64 MiB.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from liveloop.server.http_guard import guarded_protocol
from liveloop.server.main import bind_socket

READ_TIMEOUT_S = 1.0
STALL_TIMEOUT_S = 1.0
MAX_HEAD = 4096


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    headers = [(b"content-type", b"application/octet-stream")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    if scope["path"] == "/big":
        chunk = b"x" * (1 << 20)
        for _ in range(64):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    else:
        await send({"type": "http.response.body", "body": b"ok:" + body})


@pytest.fixture
def server() -> Iterator[tuple[str, list[str]]]:
    """(base URL, reasons of connections the limits closed) of a guarded uvicorn server."""
    closed: list[str] = []
    protocol = guarded_protocol(
        max_header_bytes=MAX_HEAD,
        read_timeout_s=READ_TIMEOUT_S,
        write_stall_timeout_s=STALL_TIMEOUT_S,
        on_close=closed.append,
    )
    sock = bind_socket("127.0.0.1", 0)
    config = uvicorn.Config(app, http=protocol, log_config=None, lifespan="off")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", closed
    srv.should_exit = True
    thread.join(10)
    sock.close()


def _connect(url: str, rcvbuf: int | None = None) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    return sock


def _read_all(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes; and after how long it closed."""
    sock.settimeout(timeout_s)
    started, data = time.monotonic(), b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data, time.monotonic() - started


def test_normal_requests_pass(server: tuple[str, list[str]]) -> None:
    url, closed = server
    response = httpx.post(url + "/echo", content=b"y" * 100_000, headers={"x-a": "b" * 3000})
    assert response.status_code == 200 and response.content == b"ok:" + b"y" * 100_000
    with httpx.Client(base_url=url) as client:  # keep-alive: a second request on it
        assert [client.get("/").status_code for _ in range(3)] == [200, 200, 200]
    assert closed == []


def test_silent_and_slow_heads_get_408_within_the_timeout(server: tuple[str, list[str]]) -> None:
    url, closed = server
    silent = _connect(url)
    slow = _connect(url)
    slow.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n")
    for _ in range(3):  # a header line now and then, never the end of the head
        time.sleep(0.25)
        slow.sendall(b"x-slow: 1\r\n")
    for sock in (silent, slow):
        data, waited = _read_all(sock, 5.0)
        assert data.startswith(b"HTTP/1.1 408") and b'"code": "request_timeout"' in data
        assert waited < READ_TIMEOUT_S + 2.0
        sock.close()
    assert closed.count("read_timeout") == 2


def test_a_body_that_stops_arriving_is_cut_off(server: tuple[str, list[str]]) -> None:
    url, closed = server
    sock = _connect(url)
    sock.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\nonly part")
    data, waited = _read_all(sock, 5.0)
    assert data == b"" and waited < READ_TIMEOUT_S + 2.0
    assert closed == ["read_timeout"]
    sock.close()


def test_oversized_head_gets_431(server: tuple[str, list[str]]) -> None:
    url, closed = server
    response = httpx.get(url + "/", headers={"x-big": "b" * (MAX_HEAD + 10)})
    assert response.status_code == 431
    assert response.json()["error"]["code"] == "request_header_fields_too_large"
    assert closed == ["header_too_large"]
    assert httpx.get(url + "/").status_code == 200  # the server goes on


def test_a_client_that_stops_reading_is_aborted(server: tuple[str, list[str]]) -> None:
    url, closed = server
    sock = _connect(url, rcvbuf=4096)
    sock.sendall(b"GET /big HTTP/1.1\r\nhost: x\r\n\r\n")
    sock.recv(1000)  # the response has started; now never read again
    deadline = time.monotonic() + 30
    while "write_stall" not in closed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert closed == ["write_stall"]
    sock.close()


async def test_many_silent_connections_do_not_block_others(server: tuple[str, list[str]]) -> None:
    url, closed = server
    idle = [_connect(url) for _ in range(100)]
    async with httpx.AsyncClient(base_url=url) as client:
        responses = await asyncio.gather(*(client.get("/") for _ in range(20)))
        assert all(r.status_code == 200 for r in responses)
    for sock in idle:
        assert _read_all(sock, 5.0)[0].startswith(b"HTTP/1.1 408")
        sock.close()
    assert closed.count("read_timeout") == 100
