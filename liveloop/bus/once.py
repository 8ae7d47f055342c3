"""Exactly-once writes: a stream entry and its dedupe marker in one atomic step.

Every loop that turns input into output writes the output once per input, however often
the input is delivered (a crash before the acknowledgement, a second consumer reclaiming
it). One Lua script does it for all of them:

- it refuses the write when the dedupe marker exists (`dup`), or, when `members` are given,
  when any of them is already in the member set (`taken`: a turn already in a batch);
- otherwise it sets the marker (with a TTL), adds the members, trims members older than
  `MEMBER_TTL_S`, and XADDs the entry (`ok`);
- in both cases it runs the `cleanup` given (DEL a key, or SREM a member from a set), so
  state that an output supersedes goes away in the same step.

Producers (`publish`), the judging loop's commit and the collector's batch writer use it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import redis.asyncio as aredis
from pydantic import BaseModel
from redis.asyncio.client import Pipeline

from liveloop.bus.codec import encode
from liveloop.bus.keys import dedupe_marker, stream_key

DEDUPE_TTL_S = 30 * 24 * 3600
"""How long a dedupe marker lives: a re-delivery later than this is written again."""
MEMBER_TTL_S = 7 * 24 * 3600
"""How long a member stays in a member set."""

# KEYS: 1 stream, 2 dedupe marker, 3 member set ('' when there are no members),
#       4.. cleanup keys
# ARGV: 1 marker ttl s, 2 now, 3 member cutoff, 4 number of members, then the members,
#       then one member per cleanup key ('' = DEL the key, else SREM it), then the entry's
#       field/value pairs.
_WRITE_ONCE = """
local n = tonumber(ARGV[4])
local first_cleanup = 5 + n
local first_field = first_cleanup + #KEYS - 3
local result
if redis.call('EXISTS', KEYS[2]) == 1 then
  result = {'dup'}
else
  for i = 5, first_cleanup - 1 do
    if redis.call('ZSCORE', KEYS[3], ARGV[i]) then
      result = {'taken', ARGV[i]}
      break
    end
  end
end
if not result then
  redis.call('SET', KEYS[2], '1', 'EX', ARGV[1])
  if n > 0 then
    for i = 5, first_cleanup - 1 do redis.call('ZADD', KEYS[3], ARGV[2], ARGV[i]) end
    redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[3])
  end
  result = {'ok', redis.call('XADD', KEYS[1], '*', unpack(ARGV, first_field))}
end
for k = 4, #KEYS do
  local member = ARGV[first_cleanup + k - 4]
  if member == '' then redis.call('DEL', KEYS[k]) else redis.call('SREM', KEYS[k], member) end
end
return result
"""


@dataclass(frozen=True)
class OnceResult:
    """Outcome of an exactly-once write."""

    status: Literal["ok", "dup", "taken"]
    entry_id: str | None = None
    taken: str | None = None  # the member already in the set (status "taken")

    @property
    def written(self) -> bool:
        """True when this call wrote the entry."""
        return self.status == "ok"

    @classmethod
    def parse(cls, reply: Any) -> OnceResult:
        """From the script's reply (as returned by `execute()` of a pipeline, too)."""
        status = str(reply[0])
        if status == "ok":
            return cls("ok", entry_id=str(reply[1]))
        if status == "taken":
            return cls("taken", taken=str(reply[1]))
        return cls("dup")


@dataclass(frozen=True)
class Cleanup:
    """State to drop together with a write: `key` deleted, or `member` removed from set `key`."""

    key: str
    member: str = ""


class ExactlyOnce:
    """Writes stream entries exactly once per dedupe key (see the module docstring)."""

    def __init__(self, client: aredis.Redis, ttl_s: int = DEDUPE_TTL_S) -> None:
        self.client = client
        self.ttl_s = ttl_s
        self._script = client.register_script(_WRITE_ONCE)

    def _call(
        self,
        stream: str,
        dedupe_key: str,
        fields: Mapping[str, str],
        members: Sequence[str],
        member_set: str | None,
        cleanup: Sequence[Cleanup],
    ) -> tuple[list[str], list[str | int | float]]:
        if members and member_set is None:
            raise ValueError("members need a member set")
        keys = [stream_key(stream), dedupe_marker(stream, dedupe_key), member_set or ""]
        keys += [c.key for c in cleanup]
        now = time.time()
        args: list[str | int | float] = [self.ttl_s, now, now - MEMBER_TTL_S, len(members)]
        args += members
        args += [c.member for c in cleanup]
        for name, value in fields.items():
            args += [name, value]
        return keys, args

    async def write(
        self,
        stream: str,
        dedupe_key: str,
        fields: Mapping[str, str],
        *,
        members: Sequence[str] = (),
        member_set: str | None = None,
        cleanup: Sequence[Cleanup] = (),
    ) -> OnceResult:
        """Write the entry unless `dedupe_key` (or a member) was written before."""
        keys, args = self._call(stream, dedupe_key, fields, members, member_set, cleanup)
        return OnceResult.parse(await self._script(keys=keys, args=args))

    async def queue(
        self,
        pipe: Pipeline,
        stream: str,
        dedupe_key: str,
        fields: Mapping[str, str],
        *,
        cleanup: Sequence[Cleanup] = (),
    ) -> None:
        """Queue the write on a pipeline; `OnceResult.parse` its reply after `execute()`."""
        keys, args = self._call(stream, dedupe_key, fields, (), None, cleanup)
        await self._script(keys=keys, args=args, client=pipe)


async def publish(
    client: aredis.Redis,
    stream: str,
    payload: BaseModel,
    *,
    dedupe_key: str | None = None,
    **index: str | int | float,
) -> str | None:
    """XADD a payload (see `encode`); the entry id.

    With `dedupe_key`, a second publish of the same key is a no-op and returns None.
    """
    fields = encode(payload, **index)
    if dedupe_key is None:
        return str(await client.xadd(stream_key(stream), fields))  # type: ignore[arg-type]
    result = await ExactlyOnce(client).write(stream, dedupe_key, fields)
    return result.entry_id
