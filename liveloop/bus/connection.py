"""Redis/Valkey clients: the one place where a LiveLoop process opens a connection.

Every client decodes responses to `str`. `connect`/`connect_sync` also PING, so a wrong URL
fails at start-up with `BusUnavailable` naming the server (never the password);
`redis_client`/`redis_client_sync` return a client without connecting, for callers that
must start while Redis is away (the trace writer, the weight follower).
"""

from __future__ import annotations

import redis
import redis.asyncio as aredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff


class BusUnavailable(ConnectionError):
    """Redis/Valkey cannot be reached; the message names the URL."""


def describe(url: str) -> str:
    """A URL fit for logs and errors: the credentials part is dropped."""
    return url.split("@")[-1]


def redis_client(
    url: str,
    *,
    timeout_s: float | None = None,
    connect_timeout_s: float | None = None,
    retries: bool = True,
) -> aredis.Redis:
    """An async client (not connected yet).

    `timeout_s` bounds every command (None: no bound, for blocking reads);
    `connect_timeout_s` (default: `timeout_s`) bounds connecting; `retries=False` turns off
    redis-py's own retries, for callers with a retry policy of their own.
    """
    if retries:
        return aredis.from_url(
            url,
            decode_responses=True,
            socket_timeout=timeout_s,
            socket_connect_timeout=connect_timeout_s or timeout_s,
        )
    return aredis.from_url(
        url,
        decode_responses=True,
        socket_timeout=timeout_s,
        socket_connect_timeout=connect_timeout_s or timeout_s,
        retry=AsyncRetry(NoBackoff(), 0),
    )


def redis_client_sync(url: str, *, timeout_s: float | None = None) -> redis.Redis:
    """A blocking client (not connected yet); `timeout_s` bounds every command."""
    return redis.Redis.from_url(
        url, decode_responses=True, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
    )


async def connect(url: str, *, timeout_s: float | None = None) -> aredis.Redis:
    """An async client that answered PING; raises BusUnavailable with a one-line reason."""
    try:
        client = redis_client(url, timeout_s=timeout_s)
        await client.ping()
    except (redis.RedisError, OSError, ValueError) as exc:
        raise BusUnavailable(f"cannot reach Redis at {describe(url)}: {exc}") from None
    return client


def connect_sync(url: str, *, timeout_s: float | None = None) -> redis.Redis:
    """A blocking client that answered PING; raises BusUnavailable with a one-line reason."""
    try:
        client = redis_client_sync(url, timeout_s=timeout_s)
        client.ping()
    except (redis.RedisError, OSError, ValueError) as exc:
        raise BusUnavailable(f"cannot reach Redis at {describe(url)}: {exc}") from None
    return client
