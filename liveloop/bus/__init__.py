"""The stream bus every loop shares: keys, connections, entries, exactly-once writes, consumers.

- `keys`: the name of every Redis key and stream (`liveloop:<name>`, dead letters in
  `liveloop:<name>:dlq`);
- `connection`: the only way a process opens a Redis/Valkey client;
- `codec`: a contract in an entry (`data` JSON plus index fields) and back;
- `once`: exactly-once writes (an entry and its dedupe marker in one atomic step), and
  `publish` for producers;
- `consumer`: `StreamConsumer`, at-least-once consumption in a consumer group with
  in-flight tracking, retry backoff, dead-lettering and pipelined acknowledgements;
- `retention` and `archive`: what every group is done with, archived to disk and trimmed
  (run by the collecting loop), read back by replays; `archive_purge` deletes a tenant's
  entries from that archive.
"""

from liveloop.bus import keys
from liveloop.bus.codec import Entry, decode, decode_entries, encode
from liveloop.bus.connection import (
    BusUnavailable,
    connect,
    connect_sync,
    describe,
    redis_client,
    redis_client_sync,
)
from liveloop.bus.consumer import StreamConsumer, default_consumer_name
from liveloop.bus.keys import (
    BATCHES,
    COLLECTOR_GROUP,
    FEEDBACK,
    PREFIX,
    PRM_GROUP,
    SCORED,
    STREAMS,
    TRAINER_GROUP,
    TURNS,
    WEIGHTS,
    dedupe_marker,
    dlq_key,
    stream_key,
)
from liveloop.bus.once import DEDUPE_TTL_S, Cleanup, ExactlyOnce, OnceResult, publish

__all__ = [
    "BATCHES",
    "COLLECTOR_GROUP",
    "DEDUPE_TTL_S",
    "FEEDBACK",
    "PREFIX",
    "PRM_GROUP",
    "SCORED",
    "STREAMS",
    "TRAINER_GROUP",
    "TURNS",
    "WEIGHTS",
    "BusUnavailable",
    "Cleanup",
    "Entry",
    "ExactlyOnce",
    "OnceResult",
    "StreamConsumer",
    "connect",
    "connect_sync",
    "decode",
    "decode_entries",
    "dedupe_marker",
    "default_consumer_name",
    "describe",
    "dlq_key",
    "encode",
    "keys",
    "publish",
    "redis_client",
    "redis_client_sync",
    "stream_key",
]
