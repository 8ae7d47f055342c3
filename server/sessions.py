"""Sessions: which conversation a request belongs to, and which assistant turn it is.

A request names its session with `X-Session-Id` (or `metadata.session_id`); without one,
it joins the session of an earlier turn whose messages (request + the assistant reply) are
a prefix of its own messages, found by a chain hash of the message list; otherwise a new
session starts. Session state lives in Redis with a TTL: the owning tenant, the number of
assistant turns (the next `turn_index`), and for each served sample the prompt and
completion token ids, so the next turn's prompt can extend them token-exactly.

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

log = logging.getLogger(__name__)

SESSION_PREFIX = "liveloop:session:"
PREFIX_INDEX = "liveloop:prefix:"
REDIS_TIMEOUT_S = 0.5
BACKOFF_S = 2.0
LOCAL_CACHE = 10_000

# KEYS: prefix-index keys, longest prefix first. ARGV: tenant, ttl, explicit sid, new sid, now.
_RESOLVE = """
local tenant, ttl, sid, now = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[5]
local match = ''
for _, key in ipairs(KEYS) do
  local v = redis.call('GET', key)
  if v then
    local nl = string.find(v, '\\n', 1, true)
    local vsid = string.sub(v, 1, nl - 1)
    if sid == '' or sid == vsid then
      sid = vsid
      match = v
      break
    end
  end
end
if sid == '' then sid = ARGV[4] end
local skey = 'liveloop:session:' .. sid
local owner = redis.call('HGET', skey, 'tenant')
if owner and owner ~= tenant then return {'forbidden', sid, -1, ''} end
if not owner then redis.call('HSET', skey, 'tenant', tenant, 'created_at', now) end
local idx = redis.call('HINCRBY', skey, 'turns', 1) - 1
redis.call('HSET', skey, 'updated_at', now)
redis.call('EXPIRE', skey, ttl)
return {'ok', sid, idx, match}
"""


class SessionForbidden(PermissionError):
    """The named session belongs to another tenant."""


@dataclass
class PreviousTurn:
    """The served sample a request continues: its token ids, for token-exact extension."""

    turn_index: int
    sample_index: int
    prompt_token_ids: list[int]
    completion_token_ids: list[int]


@dataclass
class SessionTurn:
    """Where a request sits: its session, its turn index, and the turn it continues."""

    session_id: str
    turn_index: int
    previous: PreviousTurn | None = None
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
            [c.get("function", {}).get("name"), c.get("function", {}).get("arguments")]
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

    def __init__(self, client: aredis.Redis, ttl_s: int) -> None:
        self.client = client
        self.ttl_s = ttl_s
        self._script = client.register_script(_RESOLVE)
        self._down_until = 0.0
        self._local_turns: OrderedDict[str, int] = OrderedDict()

    @staticmethod
    def _prefix_key(tenant: str, digest: str) -> str:
        return f"{PREFIX_INDEX}{tenant}:{digest}"

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

    def _local_turn(self, session_id: str | None) -> SessionTurn:
        sid = session_id or new_session_id()
        index = self._local_turns.get(sid, -1) + 1
        self._note_turn(sid, index)
        return SessionTurn(sid, index)

    async def resolve(
        self, tenant: str, messages: Sequence[dict[str, Any]], session_id: str | None
    ) -> SessionTurn:
        """Find or create the session of a request and allocate its turn index."""
        digests = chain_hashes(messages)
        keys = [
            self._prefix_key(tenant, digests[i])
            for i in range(len(messages) - 1, -1, -1)
            if messages[i].get("role") == "assistant"
        ]
        if not self._available():
            return self._local_turn(session_id)
        args = [tenant, self.ttl_s, session_id or "", new_session_id(), f"{time.time():.3f}"]
        try:
            reply = await asyncio.wait_for(self._script(keys, args), REDIS_TIMEOUT_S)
        except (redis.RedisError, OSError, TimeoutError) as exc:
            self._failed("resolve", exc)
            return self._local_turn(session_id)
        status, sid, index, match = reply
        if status == "forbidden":
            raise SessionForbidden(f"session {sid} belongs to another tenant")
        self._note_turn(str(sid), int(index))
        turn = SessionTurn(str(sid), int(index), linked=bool(match) and session_id is None)
        if match:
            turn.previous = _parse_previous(str(match))
        return turn

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
                    key = self._prefix_key(tenant, digest)
                    pipe.set(key, f"{session_id}\n{value}", ex=self.ttl_s)
                await asyncio.wait_for(pipe.execute(), REDIS_TIMEOUT_S)
        except (redis.RedisError, OSError, TimeoutError) as exc:
            self._failed("remember", exc)

    async def owner(self, session_id: str) -> tuple[str | None, int]:
        """(tenant owning the session or None if unknown, number of turns); raises on Redis errors."""
        tenant, turns = await self.client.hmget(SESSION_PREFIX + session_id, ["tenant", "turns"])  # type: ignore[misc]
        return tenant, int(turns or 0)


def _parse_previous(value: str) -> PreviousTurn | None:
    try:
        data = json.loads(value.split("\n", 1)[1])
        return PreviousTurn(
            turn_index=int(data["turn_index"]),
            sample_index=int(data["sample_index"]),
            prompt_token_ids=[int(t) for t in data["prompt_token_ids"]],
            completion_token_ids=[int(t) for t in data["completion_token_ids"]],
        )
    except (IndexError, KeyError, TypeError, ValueError) as exc:
        log.warning("ignoring unreadable prefix-index entry: %s", exc)
        return None
