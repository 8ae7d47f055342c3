"""Durable next-state pairing in Redis, shared by every judge process.

A main turn t of session s waits in Redis (`w:<turn key>`, in the group set `g:<s>:<t>` and
in the `deadlines` sorted set) until one of three things happens, each detected by one
atomic Lua script so that several judge processes never pair a turn twice:

- turn t+1 of s arrives: its request messages become t's next state;
- explicit feedback on (s, t) arrives;
- the deadline passes (the sweeper).

Whoever removes a turn from `deadlines` owns it and appends a job to the internal stream
`liveloop:prm:ready`, which the scorer consumes in the consumer group `prm` (so a job, too,
is retried, reclaimed and dead-lettered). Turn t+1 arriving before t (two processes racing)
leaves an arrival note `a:<s>:<t+1>`; feedback arriving before its turn is kept in
`fb:<s>:<t>`. Committing a score atomically writes the scored entry once (the same dedupe
marker as `liveloop.bus.publish`) and deletes the pairing state.

Side turns (a title, a summary: calls that are not part of the conversation) take turn
indices too, but they are nobody's next state. Each leaves a marker `side:<s>:<j>`, and a
main turn looking for its predecessor steps back over marked indices, so main turn t's next
state is the next *main* turn, whatever side turns came between. A side turn arriving after
the main turn that follows it forwards that turn's arrival note past itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aredis
from redis.asyncio.client import Pipeline

from liveloop import bus
from liveloop.contracts import Feedback, TurnRecord
from liveloop.prm.judges.base import TurnHead

PREFIX = "liveloop:prm:"
READY = PREFIX + "ready"

# Key names are built inside the scripts from the session, index and sample (fewer
# arguments per call is most of the client's cost per turn); the scripts touch several
# sessions' keys at once anyway, so they target a single Redis/Valkey, not a cluster.
# KEYS: 1 deadlines, 2 ready
# ARGV: 1 state prefix, 2 seen-marker prefix, 3 session, 4 index, 5 sample, 6 turn json,
#       7 messages json, 8 timeout s, 9 ttl s, 10 arrival ttl s
# The shared head of both scripts: `pair_back(k, nxt)` gives the messages `nxt` of a main
# turn at index k (or forwarded to k by a side turn) to the nearest main turn before k:
# paired at once when it waits, else left as an arrival note for it. Returns turns paired.
_PAIR_BACK = """
local P, SEEN, s = ARGV[1], ARGV[2], ARGV[3]
local function pair_back(k, nxt, note_ttl)
  local m = k - 1
  while m >= 0 and redis.call('EXISTS', P .. 'side:' .. s .. ':' .. m) == 1 do m = m - 1 end
  if m < 0 then return 0 end
  local prev = P .. 'g:' .. s .. ':' .. m
  local members = redis.call('SMEMBERS', prev)
  local claimed = {}
  for _, member in ipairs(members) do
    if redis.call('ZREM', KEYS[1], member) == 1 then table.insert(claimed, member) end
  end
  if #claimed > 0 then
    redis.call('XADD', KEYS[2], '*', 'keys', cjson.encode(claimed), 'next', nxt)
    redis.call('DEL', prev)
    return #claimed
  end
  if #members == 0 and redis.call('EXISTS', SEEN .. s .. ':' .. m .. ':0') == 0 then
    redis.call('SET', P .. 'a:' .. s .. ':' .. (m + 1), nxt, 'EX', note_ttl)
  end
  return 0
end
"""

_ADD_TURN = (
    _PAIR_BACK
    + """
local idx = ARGV[4]
local k = tonumber(idx)
local key = s .. ':' .. idx .. ':' .. ARGV[5]
local waiting = P .. 'w:' .. key
if redis.call('EXISTS', waiting) == 1 or redis.call('EXISTS', SEEN .. key) == 1 then
  return {'duplicate', 0}
end
local ttl = tonumber(ARGV[9])
local paired = pair_back(k, ARGV[7], tonumber(ARGV[10]))
local group = P .. 'g:' .. s .. ':' .. idx
redis.call('SET', waiting, ARGV[6], 'EX', ttl)
redis.call('SADD', group, key)
redis.call('EXPIRE', group, ttl)
local fb = redis.call('GET', P .. 'fb:' .. s .. ':' .. idx)
local nxt = redis.call('GET', P .. 'a:' .. s .. ':' .. (k + 1))
if fb or nxt then
  local job = {'keys', cjson.encode({key})}
  if nxt then table.insert(job, 'next'); table.insert(job, nxt) end
  if fb then table.insert(job, 'feedback'); table.insert(job, fb) end
  redis.call('XADD', KEYS[2], '*', unpack(job))
  return {'ready', paired}
end
local t = redis.call('TIME')
local deadline = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[8])
redis.call('ZADD', KEYS[1], string.format('%.6f', deadline), key)
return {'waiting', paired}
"""
)

# KEYS: 1 deadlines, 2 ready
# ARGV: 1 state prefix, 2 seen-marker prefix, 3 session, 4 index, 5 ttl s, 6 arrival ttl s
_ADD_SIDE = (
    _PAIR_BACK
    + """
local k = tonumber(ARGV[4])
redis.call('SET', P .. 'side:' .. s .. ':' .. k, '1', 'EX', tonumber(ARGV[5]))
local note = P .. 'a:' .. s .. ':' .. (k + 1)
local nxt = redis.call('GET', note)
if not nxt then return 0 end
redis.call('DEL', note)
return pair_back(k, nxt, tonumber(ARGV[6]))
"""
)

# KEYS: 1 group, 2 feedback key, 3 deadlines, 4 ready, 5 seen marker of sample 0
# ARGV: 1 feedback json, 2 ttl s
_ADD_FEEDBACK = """
local members = redis.call('SMEMBERS', KEYS[1])
local claimed = {}
for _, m in ipairs(members) do
  if redis.call('ZREM', KEYS[3], m) == 1 then table.insert(claimed, m) end
end
if #claimed > 0 then
  redis.call('XADD', KEYS[4], '*', 'keys', cjson.encode(claimed), 'feedback', ARGV[1])
  return 'paired'
end
if #members == 0 and redis.call('EXISTS', KEYS[5]) == 0 then
  redis.call('SET', KEYS[2], ARGV[1], 'NX', 'EX', tonumber(ARGV[2]))
  return 'stored'
end
return 'late'
"""

# KEYS: 1 deadlines, 2 ready; ARGV: 1 limit
_SWEEP = """
local t = redis.call('TIME')
local now = string.format('%.6f', tonumber(t[1]) + tonumber(t[2]) / 1000000)
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
for _, m in ipairs(due) do
  redis.call('ZREM', KEYS[1], m)
  redis.call('XADD', KEYS[2], '*', 'keys', cjson.encode({m}))
end
return #due
"""

# KEYS: 1 scored stream
# ARGV: 1 state prefix, 2 seen-marker prefix, 3 session, 4 index, 5 sample, 6 dedupe ttl s,
#       7 data, 8.. more index fields (name, value, ...)
_COMMIT = """
local P, s, idx = ARGV[1], ARGV[3], ARGV[4]
local key = s .. ':' .. idx .. ':' .. ARGV[5]
local added = 0
if redis.call('SET', ARGV[2] .. key, '1', 'NX', 'EX', tonumber(ARGV[6])) then
  redis.call('XADD', KEYS[1], '*', 'data', ARGV[7], 'session_id', s, 'turn_index', idx,
             unpack(ARGV, 8))
  added = 1
end
redis.call('DEL', P .. 'w:' .. key)
redis.call('SREM', P .. 'g:' .. s .. ':' .. idx, key)
return added
"""


def seen_marker(stream: str, dedupe_key: str) -> str:
    """The exactly-once marker `liveloop.bus.publish` uses for (stream, dedupe key)."""
    return bus.dedupe_marker(stream, dedupe_key)


@dataclass
class PendingTurn:
    """What pairing needs of a main turn: its identity, raw record and request messages."""

    key: str
    session_id: str
    turn_index: int
    sample_index: int
    raw: str
    messages_json: str

    @classmethod
    def from_record(cls, turn: TurnRecord, raw: str) -> PendingTurn:
        """From a parsed record and the JSON it was parsed from."""
        messages = json.dumps(turn.messages)
        return cls(turn.key, turn.session_id, turn.turn_index, turn.sample_index, raw, messages)


class PairingStore:
    """The Redis side of pairing: add turns and feedback, sweep deadlines, load and commit."""

    def __init__(
        self,
        client: aredis.Redis,
        *,
        timeout_s: float,
        ttl_s: int,
        arrival_ttl_s: int = 3600,
        scored_stream: str = bus.SCORED,
    ) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self.arrival_ttl_s = arrival_ttl_s
        self.scored_stream = bus.stream_key(scored_stream)
        self.deadlines = PREFIX + "deadlines"
        self._add_turn = client.register_script(_ADD_TURN)
        self._add_side = client.register_script(_ADD_SIDE)
        self._add_feedback = client.register_script(_ADD_FEEDBACK)
        self._sweep = client.register_script(_SWEEP)
        self._commit = client.register_script(_COMMIT)

    # Key layout ---------------------------------------------------------------------
    @staticmethod
    def waiting_key(turn_key: str) -> str:
        """Where a waiting turn's raw record is kept."""
        return f"{PREFIX}w:{turn_key}"

    @staticmethod
    def group_key(session_id: str, turn_index: int) -> str:
        """The set of waiting samples of one (session, turn)."""
        return f"{PREFIX}g:{session_id}:{turn_index}"

    # Operations ---------------------------------------------------------------------
    async def add_turns(self, turns: list[PendingTurn]) -> list[Any]:
        """Store and pair main turns; per turn (state, predecessors paired) or an exception.

        state is 'waiting' (for its next state), 'ready' (next turn or feedback already
        known) or 'duplicate' (seen before).
        """
        if not turns:
            return []
        seen = seen_marker(self.scored_stream, "")
        keys = [self.deadlines, READY]
        async with self.client.pipeline(transaction=False) as pipe:
            for t in turns:
                args: list[str | int | float] = [PREFIX, seen, t.session_id, t.turn_index]
                args += [t.sample_index, t.raw]
                args += [t.messages_json, self.timeout_s, self.ttl_s, self.arrival_ttl_s]
                await self._add_turn(keys=keys, args=args, client=pipe)
            return list(await pipe.execute(raise_on_error=False))

    async def add_side_turns(self, turns: list[tuple[str, int]]) -> list[Any]:
        """Mark (session, index) as side turns; per turn, predecessors paired or an exception."""
        if not turns:
            return []
        seen = seen_marker(self.scored_stream, "")
        keys = [self.deadlines, READY]
        async with self.client.pipeline(transaction=False) as pipe:
            for session_id, turn_index in turns:
                args: list[str | int] = [PREFIX, seen, session_id, turn_index, self.ttl_s]
                args.append(self.arrival_ttl_s)
                await self._add_side(keys=keys, args=args, client=pipe)
            return list(await pipe.execute(raise_on_error=False))

    async def add_feedback(self, items: list[tuple[Feedback, str]]) -> list[Any]:
        """Pair feedback (parsed, raw JSON) with waiting turns: 'paired', 'stored' or 'late'."""
        if not items:
            return []
        async with self.client.pipeline(transaction=False) as pipe:
            for fb, raw in items:
                s, k = fb.session_id, fb.turn_index
                keys = [
                    self.group_key(s, k),
                    f"{PREFIX}fb:{s}:{k}",
                    self.deadlines,
                    READY,
                    seen_marker(self.scored_stream, f"{s}:{k}:0"),
                ]
                await self._add_feedback(keys=keys, args=[raw, self.ttl_s], client=pipe)
            return list(await pipe.execute(raise_on_error=False))

    async def sweep(self, limit: int = 1000) -> int:
        """Move up to `limit` turns past their deadline to the ready stream."""
        return int(await self._sweep(keys=[self.deadlines, READY], args=[limit]))

    async def load(self, turn_keys: list[str]) -> list[str | None]:
        """Raw records of waiting turns (None where the state is gone)."""
        if not turn_keys:
            return []
        raws: list[Any] = await self.client.mget([self.waiting_key(k) for k in turn_keys])
        return [str(r) if r is not None else None for r in raws]

    async def queue_commit(
        self, pipe: Pipeline, turn: TurnRecord | TurnHead, fields: dict[str, str]
    ) -> None:
        """Queue: write the scored entry once and forget the turn's pairing state.

        `fields` are the entry's fields: `data`, `session_id`, `turn_index` and any others.
        """
        args: list[str | int] = [PREFIX, seen_marker(self.scored_stream, "")]
        args += [turn.session_id, turn.turn_index, turn.sample_index, bus.DEDUPE_TTL_S]
        args.append(fields["data"])
        for name, value in fields.items():
            if name not in ("data", "session_id", "turn_index"):
                args += [name, value]
        await self._commit(keys=[self.scored_stream], args=args, client=pipe)

    def queue_drop(self, pipe: Pipeline, turn_key: str, session_id: str, turn_index: int) -> None:
        """Queue: forget a turn's pairing state without writing a score."""
        pipe.delete(self.waiting_key(turn_key))
        pipe.srem(self.group_key(session_id, turn_index), turn_key)

    async def waiting_count(self) -> int:
        """How many turns wait for their next state."""
        return int(await self.client.zcard(self.deadlines))
