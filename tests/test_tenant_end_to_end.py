"""Tenant scope end to end through a real server (subprocess, real Valkey, the openai
client): tenant a's served turns (scored by the test, no judging loop runs) are batched by
the collector, trained by the trainer into a's own adapter, announced, followed and served
to a alone, while tenant b's replies at temperature 0 stay the base model's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import redis

from liveloop import bus
from liveloop.collector.loop import Collector
from liveloop.config import load_settings
from liveloop.contracts import ScoredTurn, TurnRecord
from liveloop.trainer.tenants import TenantTrainer
from liveloop.valkey import EmbeddedValkey
from tests.server_proc import ServerProcess, keyed_server
from tests.test_tenant_isolation import FAST, LORA, QUESTIONS, A, B, _ask, _replies, _served

pytestmark = pytest.mark.slow  # a server and one update: about a minute

DB = 14


@pytest.fixture(scope="module")
def server(
    valkey_server: EmbeddedValkey, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    with keyed_server(valkey_server.url, DB, tmp_path_factory.mktemp("srv")) as proc:
        yield proc


def _turns_of(server: ServerProcess, tenant: str, count: int) -> list[TurnRecord]:
    client = redis.Redis.from_url(server.redis_url)
    try:
        deadline = time.monotonic() + 30
        while True:
            entries = client.xrange(bus.stream_key(bus.TURNS))
            found = [t for t in bus.decode_entries(entries, TurnRecord) if t.tenant == tenant]
            if len(found) >= count:
                return found
            assert time.monotonic() < deadline, len(found)
            time.sleep(0.1)
    finally:
        client.close()


async def test_a_tenants_trained_adapter_is_served_to_it_alone(server: ServerProcess) -> None:
    base_b = await asyncio.to_thread(_replies, server, B)
    for i in range(4):
        await asyncio.to_thread(_ask, server, A, f"tell me something, {i}")
    turns = await asyncio.to_thread(_turns_of, server, A, 4)

    trainer_cfg = {"scope": "tenant", "lora": LORA, "lr": 1e-2, "max_updates": 1,
                   "read_block_ms": 100, "gate": {"enabled": False},
                   "watch": {"enabled": False}}  # fmt: skip
    s = load_settings(redis_url=server.redis_url, data_dir=server.data_dir, model="tiny-random",
                      collector=FAST, trainer=trainer_cfg)  # fmt: skip
    client = await bus.connect(server.redis_url)
    try:
        for turn in turns:
            await bus.publish(client, bus.SCORED, ScoredTurn(**turn.model_dump(), score=1.0,
                                                              judge="rules"))  # fmt: skip
        collector = Collector(s.shared(), s.collector, client, tenant_scope=True)
        await collector.start()
        for _ in range(3):
            await collector.step(block_ms=20)
            await asyncio.sleep(0.06)
    finally:
        await client.aclose()
    trainer = TenantTrainer(s.shared(), s.trainer, judging=s.prm)
    await trainer.run()
    assert trainer.lanes[A].state.version == 1 and list(trainer.lanes) == [A]

    deadline = time.monotonic() + 60
    while _served(server).get(A, {}).get("version") != 1:
        assert time.monotonic() < deadline, _served(server)
        await asyncio.sleep(0.1)
    assert _served(server)[A]["tenants"] == [A]
    headers, _ = await asyncio.to_thread(_ask, server, A, QUESTIONS[0])
    assert headers["x-policy-adapter"] == A and headers["x-policy-version"] == "1"
    headers, _ = await asyncio.to_thread(_ask, server, B, QUESTIONS[0])
    assert "x-policy-adapter" not in headers
    assert await asyncio.to_thread(_replies, server, B) == base_b
