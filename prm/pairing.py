"""Durable next-state pairing in Redis, shared by every judge process.

A main turn t of session s waits in Redis (its record, in the group set of (s, t) and in the
`deadlines` sorted set; every key name comes from `liveloop.bus.keys`) until one of three
things happens, each detected by one atomic Lua script so that several judge processes
never pair a turn twice:

- turn t+1 of s arrives: its request messages become t's next state;
- explicit feedback on (s, t) arrives;
- the deadline passes (the sweeper).

Whoever removes a turn from `deadlines` owns it and appends a job to the internal stream
`liveloop:prm:ready`, which the scorer consumes in the consumer group `prm` (so a job, too,
is retried, reclaimed and dead-lettered). Turn t+1 arriving before t (two processes racing)
leaves an arrival note for t+1; feedback arriving before its turn is kept until it comes.
Committing a score is one exactly-once write (`liveloop.bus.ExactlyOnce`): the scored entry
once per turn key, and the turn's pairing state deleted in the same step.

Side turns (a title, a summary: calls that are not part of the conversation) take turn
indices too, but they are nobody's next state. Each leaves a side marker, and a main turn
looking for its predecessor steps back over marked indices, so main turn t's next state is
the next *main* turn, whatever side turns came between. A side turn arriving after the main
turn that follows it forwards that turn's arrival note past itself.

The scripts touch several sessions' keys at once, so they target a single Redis/Valkey, not
a cluster. Walking back over side turns needs the keys of other turn indices of the
session: Python passes their layouts as templates (`index_template`) that the scripts
fill with an index, so no key name is spelled out in Lua.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aredis
from redis.asyncio.client import Pipeline

from liveloop import bus
from liveloop.bus import keys
from liveloop.contracts import Feedback, TurnRecord, group_key, turn_key
from liveloop.prm.judges.base import TurnHead

_SLOT = "\x00"  # where a template takes the turn index

# The shared head of the turn scripts. ARGV 1-4 are templates of this session's keys by
# turn index (filled with string.format): 1 side marker, 2 waiting group, 3 seen marker of
# sample 0, 4 arrival note. `pair_back(k, nxt)` gives the messages `nxt` of a main turn at
# index k (or forwarded to k by a side turn) to the nearest main turn before k: paired at
# once when it waits, else left as an arrival note for it. Returns turns paired.
_PAIR_BACK = """
local SIDE, GROUP, SEEN0, ARRIVAL = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local function at(template, m) return string.format(template, m) end
local function pair_back(k, nxt, note_ttl)
  local m = k - 1
  while m >= 0 and redis.call('EXISTS', at(SIDE, m)) == 1 do m = m - 1 end
  if m < 0 then return 0 end
  local prev = at(GROUP, m)
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
  if #members == 0 and redis.call('EXISTS', at(SEEN0, m)) == 0 then
    redis.call('SET', at(ARRIVAL, m + 1), nxt, 'EX', note_ttl)
  end
  return 0
end
"""

# KEYS: 1 deadlines, 2 ready, 3 waiting record, 4 seen marker of this turn,
#       5 early feedback on this turn
# ARGV: 1-4 templates (above), 5 index, 6 turn key, 7 turn json, 8 messages json,
#       9 timeout s, 10 ttl s, 11 arrival ttl s
_ADD_TURN = (
    _PAIR_BACK
    + """
local k = tonumber(ARGV[5])
local key = ARGV[6]
if redis.call('EXISTS', KEYS[3]) == 1 or redis.call('EXISTS', KEYS[4]) == 1 then
  return {'duplicate', 0}
end
local ttl = tonumber(ARGV[10])
local paired = pair_back(k, ARGV[8], tonumber(ARGV[11]))
local group = at(GROUP, k)
redis.call('SET', KEYS[3], ARGV[7], 'EX', ttl)
redis.call('SADD', group, key)
redis.call('EXPIRE', group, ttl)
local fb = redis.call('GET', KEYS[5])
local nxt = redis.call('GET', at(ARRIVAL, k + 1))
if fb or nxt then
  local job = {'keys', cjson.encode({key})}
  if nxt then table.insert(job, 'next'); table.insert(job, nxt) end
  if fb then table.insert(job, 'feedback'); table.insert(job, fb) end
  redis.call('XADD', KEYS[2], '*', unpack(job))
  return {'ready', paired}
end
local t = redis.call('TIME')
local deadline = tonumber(t[1]) + tonumber(t[2]) / 1000000 + tonumber(ARGV[9])
redis.call('ZADD', KEYS[1], string.format('%.6f', deadline), key)
return {'waiting', paired}
"""
)

# KEYS: 1 deadlines, 2 ready
# ARGV: 1-4 templates (above), 5 index, 6 ttl s, 7 arrival ttl s
_ADD_SIDE = (
    _PAIR_BACK
    + """
local k = tonumber(ARGV[5])
redis.call('SET', at(SIDE, k), '1', 'EX', tonumber(ARGV[6]))
local note = at(ARRIVAL, k + 1)
local nxt = redis.call('GET', note)
if not nxt then return 0 end
redis.call('DEL', note)
return pair_back(k, nxt, tonumber(ARGV[7]))
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


def index_template(key_of: Callable[[int | str], str]) -> str:
    """A key layout with the turn index left open: Lua's `string.format(template, index)`."""
    return key_of(_SLOT).replace("%", "%%").replace(_SLOT, "%d")


@dataclass
class PendingTurn:
    """What pairing needs of a main turn: its identity, raw record and request messages."""

    key: str
    session_id: str
    turn_index: int
    raw: str
    messages_json: str

    @classmethod
    def from_record(cls, turn: TurnRecord, raw: str) -> PendingTurn:
        """From a parsed record and the JSON it was parsed from."""
        messages = json.dumps(turn.messages)
        return cls(turn.key, turn.session_id, turn.turn_index, raw, messages)


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
        self.deadlines = keys.PRM_DEADLINES
        self.once = bus.ExactlyOnce(client)
        self._add_turn = client.register_script(_ADD_TURN)
        self._add_side = client.register_script(_ADD_SIDE)
        self._add_feedback = client.register_script(_ADD_FEEDBACK)
        self._sweep = client.register_script(_SWEEP)

    def seen(self, turn: str) -> str:
        """The exactly-once marker of a turn's scored entry."""
        return bus.dedupe_marker(self.scored_stream, turn)

    def templates(self, session_id: str) -> list[str]:
        """The session's key templates the turn scripts take as ARGV 1-4."""
        return [
            index_template(lambda i: keys.side_marker(group_key(session_id, i))),
            index_template(lambda i: keys.waiting_group(group_key(session_id, i))),
            index_template(lambda i: self.seen(turn_key(session_id, i, 0))),
            index_template(lambda i: keys.arrival_key(group_key(session_id, i))),
        ]

    async def add_turns(self, turns: list[PendingTurn]) -> list[Any]:
        """Store and pair main turns; per turn (state, predecessors paired) or an exception.

        state is 'waiting' (for its next state), 'ready' (next turn or feedback already
        known) or 'duplicate' (seen before).
        """
        if not turns:
            return []
        async with self.client.pipeline(transaction=False) as pipe:
            for t in turns:
                script_keys = [self.deadlines, keys.PRM_READY, keys.waiting_key(t.key)]
                group = group_key(t.session_id, t.turn_index)
                script_keys += [self.seen(t.key), keys.early_feedback_key(group)]
                args: list[str | int | float] = [*self.templates(t.session_id), t.turn_index]
                args += [t.key, t.raw, t.messages_json, self.timeout_s]
                args += [self.ttl_s, self.arrival_ttl_s]
                await self._add_turn(keys=script_keys, args=args, client=pipe)
            return list(await pipe.execute(raise_on_error=False))

    async def add_side_turns(self, turns: list[tuple[str, int]]) -> list[Any]:
        """Mark (session, index) as side turns; per turn, predecessors paired or an exception."""
        if not turns:
            return []
        script_keys = [self.deadlines, keys.PRM_READY]
        async with self.client.pipeline(transaction=False) as pipe:
            for session_id, turn_index in turns:
                args: list[str | int] = [*self.templates(session_id), turn_index]
                args += [self.ttl_s, self.arrival_ttl_s]
                await self._add_side(keys=script_keys, args=args, client=pipe)
            return list(await pipe.execute(raise_on_error=False))

    async def add_feedback(self, items: list[tuple[Feedback, str]]) -> list[Any]:
        """Pair feedback (parsed, raw JSON) with waiting turns: 'paired', 'stored' or 'late'."""
        if not items:
            return []
        async with self.client.pipeline(transaction=False) as pipe:
            for fb, raw in items:
                group = group_key(fb.session_id, fb.turn_index)
                script_keys = [
                    keys.waiting_group(group),
                    keys.early_feedback_key(group),
                    self.deadlines,
                    keys.PRM_READY,
                    self.seen(turn_key(fb.session_id, fb.turn_index, 0)),
                ]
                await self._add_feedback(keys=script_keys, args=[raw, self.ttl_s], client=pipe)
            return list(await pipe.execute(raise_on_error=False))

    async def sweep(self, limit: int = 1000) -> int:
        """Move up to `limit` turns past their deadline to the ready stream."""
        return int(await self._sweep(keys=[self.deadlines, keys.PRM_READY], args=[limit]))

    async def load(self, turn_keys: list[str]) -> list[str | None]:
        """Raw records of waiting turns (None where the state is gone)."""
        if not turn_keys:
            return []
        raws: list[Any] = await self.client.mget([keys.waiting_key(k) for k in turn_keys])
        return [str(r) if r is not None else None for r in raws]

    def _state(self, turn: TurnRecord | TurnHead) -> list[bus.Cleanup]:
        group = keys.waiting_group(group_key(turn.session_id, turn.turn_index))
        return [bus.Cleanup(keys.waiting_key(turn.key)), bus.Cleanup(group, turn.key)]

    async def queue_commit(
        self, pipe: Pipeline, turn: TurnRecord | TurnHead, fields: dict[str, str]
    ) -> None:
        """Queue: write the scored entry once and forget the turn's pairing state.

        `fields` are the entry's fields (`data` and index fields); the reply parses with
        `bus.OnceResult.parse`.
        """
        await self.once.queue(pipe, self.scored_stream, turn.key, fields, cleanup=self._state(turn))

    def queue_drop(self, pipe: Pipeline, turn: TurnRecord | TurnHead) -> None:
        """Queue: forget a turn's pairing state without writing a score."""
        for item in self._state(turn):
            if item.member:
                pipe.srem(item.key, item.member)
            else:
                pipe.delete(item.key)

    async def waiting_count(self) -> int:
        """How many turns wait for their next state."""
        return int(await self.client.zcard(self.deadlines))
