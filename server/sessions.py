"""Sessions: which conversation a request belongs to, and which assistant turn it is.

A request names its session with `X-Session-Id` (or `metadata.session_id`); without one,
it joins the session of an earlier turn whose messages (request + the assistant reply) are
a prefix of its own messages, found by a chain hash of the message list; otherwise a new
session starts. Session state lives in Redis with a TTL: the owning tenant and the number
of assistant turns (the next `turn_index`, taken only once a request has passed
validation, so failed requests leave no gaps), and, per served sample, an index entry
keyed by tenant + chain hash holding the prompt and completion token ids, so the next
turn's prompt can extend them token-exactly.

Redis trouble never fails a request: the store degrades to new sessions and per-process
turn counters for a short while and logs it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aredis

from liveloop.bus.keys import prefix_index_key, session_key
from liveloop.contracts import call_arguments_value

log = logging.getLogger(__name__)

REDIS_TIMEOUT_S = 0.5
BACKOFF_S = 2.0
LOCAL_CACHE = 10_000

# KEYS: the session hash. ARGV: tenant, ttl, now, lowest acceptable index (turns this
# process already handed out while Redis was unreachable must not be reused: records are
# deduplicated by session:turn:sample). Returns the turn index, or -1 for another tenant's
# session.
_ALLOCATE = """
local skey = KEYS[1]
local owner = redis.call('HGET', skey, 'tenant')
if owner and owner ~= ARGV[1] then return -1 end
if not owner then redis.call('HSET', skey, 'tenant', ARGV[1], 'created_at', ARGV[3]) end
local idx = redis.call('HINCRBY', skey, 'turns', 1) - 1
local floor = tonumber(ARGV[4])
if idx < floor then
  redis.call('HSET', skey, 'turns', floor + 1)
  idx = floor
end
redis.call('HSET', skey, 'updated_at', ARGV[3])
redis.call('EXPIRE', skey, tonumber(ARGV[2]))
return idx
"""


class SessionForbidden(PermissionError):
    """The named session belongs to another tenant."""


@dataclass
class PreviousTurn:
    """The served sample a request continues: its token ids, for token-exact extension."""

    session_id: str
    turn_index: int
    sample_index: int
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    reply_index: int | None = None  # where the sample is in the request's messages


@dataclass
class SessionTurn:
    """Where a request sits: its session, its turn index, and the turn it continues."""

    session_id: str
    turn_index: int
    linked: bool = False  # joined an earlier session by prefix match


@dataclass
class ServedSample:
    """What `remember` stores about one sample so a follow-up can find and extend it."""

    sample_index: int
    response: dict[str, Any]
    prompt_token_ids: list[int]
    completion_token_ids: list[int]


def _flatten(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))


def canonical_message(message: dict[str, Any]) -> dict[str, Any]:
    """The parts of a message that identify it; what clients add when echoing is dropped."""
    out: dict[str, Any] = {"role": message.get("role"), "content": _flatten(message.get("content"))}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            [
                c.get("function", {}).get("name"),
                call_arguments_value(c.get("function", {}).get("arguments")),
            ]
            for c in calls
        ]
    for key in ("tool_call_id", "name"):
        if message.get(key):
            out[key] = message[key]
    return out


def chain_hashes(messages: Sequence[dict[str, Any]]) -> list[str]:
    """Hash of every prefix of the message list (`result[i]` covers messages[0..i])."""
    h = hashlib.sha256()
    digests = []
    for message in messages:
        canon = json.dumps(canonical_message(message), sort_keys=True, separators=(",", ":"))
        h.update(canon.encode() + b"\x1e")
        digests.append(h.copy().hexdigest()[:32])
    return digests


def new_session_id() -> str:
    """A fresh session id."""
    return "sess-" + uuid.uuid4().hex


class SessionStore:
    """Session resolution and turn bookkeeping in Redis, degrading gracefully without it."""

    def __init__(
        self, client: aredis.Redis, ttl_s: int, timeout_s: float = REDIS_TIMEOUT_S
    ) -> None:
        self.client = client
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s  # a call slower than this degrades (serving never waits)
        self._script = client.register_script(_ALLOCATE)
        self._down_until = 0.0
        self._local_turns: OrderedDict[str, int] = OrderedDict()

    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, exc: BaseException) -> None:
        if self._available():
            log.warning("session store: %s failed (%s); degrading for %.0fs", what, exc, BACKOFF_S)
        self._down_until = time.monotonic() + BACKOFF_S

    def _note_turn(self, session_id: str, turn_index: int) -> None:
        self._local_turns[session_id] = max(turn_index, self._local_turns.get(session_id, -1))
        self._local_turns.move_to_end(session_id)
        while len(self._local_turns) > LOCAL_CACHE:
            self._local_turns.popitem(last=False)

    def _local_turn(self, sid: str) -> SessionTurn:
        index = self._local_turns.get(sid, -1) + 1
        self._note_turn(sid, index)
        return SessionTurn(sid, index)

    async def lookup(
        self, tenant: str, messages: Sequence[dict[str, Any]], session_id: str | None
    ) -> PreviousTurn | None:
        """The latest served sample whose (messages + reply) prefix these messages, if any.

        With an explicit session id only samples of that session count.
        """
        if not self._available() or not any(m.get("role") == "assistant" for m in messages):
            return None  # only a conversation with an earlier reply can continue a turn
        digests = chain_hashes(messages)
        replies = [
            i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "assistant"
        ]
        keys = [prefix_index_key(tenant, digests[i]) for i in replies]
        try:
            values = await asyncio.wait_for(self.client.mget(keys), self.timeout_s)
        except (redis.RedisError, OSError, TimeoutError) as exc:
            self._failed("lookup", exc)
            return None
        for index, value in zip(replies, values, strict=True):
            previous = _parse_previous(str(value)) if value else None
            if previous is not None and session_id in (None, previous.session_id):
                previous.reply_index = index
                return previous
        return None

    async def allocate(self, tenant: str, session_id: str | None) -> SessionTurn:
        """Create or join a session and take the next turn index; SessionForbidden if not ours."""
        sid = session_id or new_session_id()
        if not self._available():
            return self._local_turn(sid)
        floor = self._local_turns.get(sid, -1) + 1
        args: list[str | int] = [tenant, self.ttl_s, f"{time.time():.3f}", floor]
        call = self._script(keys=[session_key(sid)], args=args)
        try:
            index = int(await asyncio.wait_for(call, self.timeout_s))
        except (redis.RedisError, OSError, TimeoutError) as exc:
            self._failed("allocate", exc)
            return self._local_turn(sid)
        if index < 0:
            raise SessionForbidden(f"session {sid} belongs to another tenant")
        self._note_turn(sid, index)
        return SessionTurn(sid, index)

    async def remember(
        self,
        tenant: str,
        session_id: str,
        turn_index: int,
        messages: Sequence[dict[str, Any]],
        samples: Sequence[ServedSample],
    ) -> None:
        """Index each served sample by the hash of (messages + its reply), with its token ids."""
        if not samples or not self._available():
            return
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for sample in samples:
                    digest = chain_hashes([*messages, sample.response])[-1]
                    value = json.dumps(
                        {
                            "turn_index": turn_index,
                            "sample_index": sample.sample_index,
                            "prompt_token_ids": sample.prompt_token_ids,
                            "completion_token_ids": sample.completion_token_ids,
                        },
                        separators=(",", ":"),
                    )
                    key = prefix_index_key(tenant, digest)
                    pipe.set(key, f"{session_id}\n{value}", ex=self.ttl_s)
                await asyncio.wait_for(pipe.execute(), self.timeout_s)
        except (redis.RedisError, OSError, TimeoutError) as exc:
            self._failed("remember", exc)

    async def owner(self, session_id: str) -> tuple[str | None, int]:
        """(tenant owning the session or None if unknown, number of turns); raises on Redis errors."""
        tenant, turns = await self.client.hmget(session_key(session_id), ["tenant", "turns"])
        return (str(tenant) if tenant is not None else None), int(turns or 0)


def _parse_previous(value: str) -> PreviousTurn | None:
    try:
        sid, payload = value.split("\n", 1)
        data = json.loads(payload)
        return PreviousTurn(
            session_id=sid,
            turn_index=int(data["turn_index"]),
            sample_index=int(data["sample_index"]),
            prompt_token_ids=[int(t) for t in data["prompt_token_ids"]],
            completion_token_ids=[int(t) for t in data["completion_token_ids"]],
        )
    except (IndexError, KeyError, TypeError, ValueError) as exc:
        log.warning("ignoring unreadable prefix-index entry: %s", exc)
        return None
