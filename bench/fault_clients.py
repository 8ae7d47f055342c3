"""Slow and broken clients: disconnects mid-stream, slow readers, silent connections.

Why: one misbehaving client must not hold engine slots or memory for long, nor slow down
everyone else. `run_slow_clients` measures a well-behaved client's latency alone, then again
while abusers run: clients that disconnect in the middle of a stream, clients that read a
stream a little at a time, connections that send nothing, and connections that send their
headers a byte at a time. It reports both latency figures, when the engine's slots were
free again, how many abusive connections the server closed itself and within what time,
and the server's memory before and after.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from pathlib import Path
from typing import Any

import httpx

from bench.fault_outages import metric
from bench.fleet import Fleet
from bench.traffic import percentile

LIMITS = {"request_read_timeout_s": 3.0, "write_stall_timeout_s": 3.0, "max_header_bytes": 16384}
LONG = {
    "model": "tiny-random",
    "messages": [{"role": "user", "content": "a long story please"}],
    "max_tokens": 600,
    "ignore_eos": True,
    "stream": True,
}


async def good_client(base_url: str, requests: int) -> list[float]:
    """Latencies (ms) of sequential short requests from one well-behaved client."""
    body = {
        "model": "tiny-random",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
    }
    out: list[float] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        for _ in range(requests):
            started = time.perf_counter()
            response = await client.post("/v1/chat/completions", json=body)
            response.raise_for_status()
            out.append((time.perf_counter() - started) * 1000)
    return out


async def disconnector(base_url: str) -> None:
    """Reads a few chunks of a long stream, then goes away."""
    async with (
        httpx.AsyncClient(base_url=base_url, timeout=60) as client,
        client.stream("POST", "/v1/chat/completions", json=LONG) as response,
    ):
        n = 0
        async for _chunk in response.aiter_bytes():
            n += 1
            if n >= 3:
                return


async def slow_reader(base_url: str, seconds: float) -> int:
    """Reads a long stream 512 bytes at a time, 20 times a second, for `seconds`."""
    host, port = base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    import json

    body = json.dumps(LONG).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    got = 0
    deadline = time.monotonic() + seconds
    with contextlib.suppress(OSError):
        while time.monotonic() < deadline:
            data = await reader.read(512)
            if not data:
                break
            got += len(data)
            await asyncio.sleep(0.05)
    writer.close()
    return got


def silent(base_url: str, count: int, slowloris: bool) -> list[socket.socket]:
    """Connections that send nothing, or only the start of a request head."""
    host, port = base_url.removeprefix("http://").split(":")
    socks = []
    for _ in range(count):
        sock = socket.create_connection((host, int(port)))
        if slowloris:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-a: ")
        socks.append(sock)
    return socks


def closed_within(socks: list[socket.socket], timeout_s: float) -> tuple[int, float]:
    """How many of the sockets the server closed within `timeout_s`, and the last time (s)."""
    started = time.monotonic()
    closed: set[int] = set()
    last = 0.0
    for sock in socks:
        sock.settimeout(0.01)
    while time.monotonic() - started < timeout_s and len(closed) < len(socks):
        for i, sock in enumerate(socks):
            if i in closed:
                continue
            try:
                data = sock.recv(4096)
            except (TimeoutError, BlockingIOError):
                continue  # still open
            except OSError:
                data = b""  # reset by the server
            if not data or data.startswith(b"HTTP/1.1 408"):
                closed.add(i)
                last = time.monotonic() - started
    for sock in socks:
        sock.close()
    return len(closed), last


def running(fleet: Fleet) -> float:
    """Sequences the engine is decoding now."""
    return metric(
        httpx.get(fleet.base_url + "/metrics", timeout=5).text, "liveloop_requests_running"
    )


async def _abuse(fleet: Fleet, requests: int, disconnects: int, readers: int) -> dict[str, Any]:
    idle = silent(fleet.base_url, 50, slowloris=False)
    loris = silent(fleet.base_url, 10, slowloris=True)
    started = time.monotonic()
    watch_idle = asyncio.create_task(asyncio.to_thread(closed_within, idle, 30.0))
    watch_loris = asyncio.create_task(asyncio.to_thread(closed_within, loris, 30.0))
    abusers = [asyncio.create_task(disconnector(fleet.base_url)) for _ in range(disconnects)]
    abusers += [asyncio.create_task(slow_reader(fleet.base_url, 8.0)) for _ in range(readers)]
    latencies = await good_client(fleet.base_url, requests)
    await asyncio.gather(*abusers, return_exceptions=True)
    idle_closed, idle_s = await watch_idle
    loris_closed, loris_s = await watch_loris
    free_at = None
    while time.monotonic() - started < 60:
        if await asyncio.to_thread(running, fleet) == 0:
            free_at = time.monotonic() - started
            break
        await asyncio.sleep(0.1)
    return {
        "latencies": latencies,
        "idle_closed": idle_closed,
        "idle_closed_within_s": round(idle_s, 1),
        "slowloris_closed": loris_closed,
        "slowloris_closed_within_s": round(loris_s, 1),
        "engine_slots_free_after_s": None if free_at is None else round(free_at, 1),
    }


def run_slow_clients(
    root: Path, *, requests: int = 30, disconnects: int = 20, readers: int = 8
) -> dict[str, Any]:
    """A good client's latency alone and among abusers; what the server freed, and when."""
    fleet = Fleet(root, {"server": LIMITS}, loops=("serve",))
    fleet.start()
    try:
        asyncio.run(good_client(fleet.base_url, 5))  # warm-up
        alone = asyncio.run(good_client(fleet.base_url, requests))
        rss_before = fleet.rss_mb().get("serve", 0.0)
        abuse = asyncio.run(_abuse(fleet, requests, disconnects, readers))
        rss_after = fleet.rss_mb().get("serve", 0.0)
        text = httpx.get(fleet.base_url + "/metrics", timeout=5).text
    finally:
        fleet.stop()
    among = abuse.pop("latencies")
    return {
        "scenario": "slow_clients",
        "limits": LIMITS,
        "good_client_alone_ms": _pcts(alone),
        "good_client_among_abusers_ms": _pcts(among),
        "disconnects": disconnects,
        "slow_readers": readers,
        "aborted_records": metric(text, 'liveloop_requests_total{finish_reason="abort"}'),
        "connections_closed_by_limits": {
            k: metric(text, f'liveloop_http_connections_closed_total{{reason="{k}"}}')
            for k in ("read_timeout", "header_too_large", "write_stall")
        },
        **abuse,
        "server_rss_mb": {"before": round(rss_before), "after": round(rss_after)},
    }


def _pcts(values: list[float]) -> dict[str, float | None]:
    return {
        f"p{int(q * 100)}": None if (v := percentile(values, q)) is None else round(v, 1)
        for q in (0.5, 0.9, 0.99)
    }
