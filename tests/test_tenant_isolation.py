"""Tenants kept apart, through a real server (subprocess, real Valkey, the openai client):
a tenant's adapter never serves another tenant (temperature 0, fixed seed: the other's
replies do not move), a tenant's turns never reach another tenant's batches (read back from
the streams after the collector ran in tenant scope), side turns and opted-out requests
behave as in shared scope, and `DELETE /admin/tenants/{key_id}` leaves nothing of a tenant
in the streams, on disk, in the registry or in the archive while the others keep being
served and batched. The judge's scores are set by the test (no judging loop runs)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from liveloop import bus
from liveloop.bus.archive import Archive, ArchiveWriter
from liveloop.collector.loop import Collector
from liveloop.config import load_settings
from liveloop.contracts import ScoredTurn, TrainingBatch, TurnRecord, WeightsAnnouncement
from liveloop.models import load_model
from liveloop.quality import QualityStore
from liveloop.registry import Registry
from liveloop.server.api.auth import tenant_id
from liveloop.valkey import EmbeddedValkey
from tests.server_proc import ADMIN_KEY, API_KEYS, ServerProcess, keyed_server
from tests.support.adapters import make_adapter

pytestmark = pytest.mark.slow  # one server for the module, about a minute in all

DB = 13
A, B = tenant_id(API_KEYS[0]), tenant_id(API_KEYS[1])
KEY = {A: API_KEYS[0], B: API_KEYS[1]}
QUESTIONS = ("Hello there", "What is the weather like?")
FAST = {"group_wait_s": 0.0, "min_turns": 1, "max_wait_s": 0.05, "max_queued_batches": None}
LORA = {"enabled": True, "rank": 4, "alpha": 8}


@pytest.fixture(scope="module")
def server(
    valkey_server: EmbeddedValkey, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    with keyed_server(valkey_server.url, DB, tmp_path_factory.mktemp("srv")) as proc:
        yield proc


@pytest.fixture(scope="module")
def base() -> Any:
    return load_model("tiny-random").model


def _admin(server: ServerProcess, method: str, path: str, **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    return httpx.request(method, server.base_url + path, headers=headers, timeout=60, **kw)


def _ask(
    server: ServerProcess, tenant: str, text: str, headers: dict[str, str] | None = None
) -> tuple[dict[str, str], str]:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY[tenant], max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-random", messages=[{"role": "user", "content": text}], max_tokens=6,
        temperature=0.0, seed=7, extra_headers=headers or {},
    )  # fmt: skip
    reply = raw.parse().choices[0].message.content or ""
    return {k.lower(): v for k, v in raw.headers.items()}, reply


def _replies(server: ServerProcess, tenant: str) -> list[str]:
    return [_ask(server, tenant, q)[1] for q in QUESTIONS]


def _announce(server: ServerProcess, path: Path, version: int, tenant: str) -> None:
    client = redis.Redis.from_url(server.redis_url)
    ann = WeightsAnnouncement(version=version, path=str(path), kind="adapter", adapter=tenant,
                              tenant=tenant)  # fmt: skip
    client.xadd(bus.stream_key(bus.WEIGHTS), {"data": ann.model_dump_json()})
    client.close()
    deadline = time.monotonic() + 60
    while _served(server).get(tenant, {}).get("version") != version:
        assert time.monotonic() < deadline, _served(server)
        time.sleep(0.1)


def _served(server: ServerProcess) -> dict[str, Any]:
    return dict(_admin(server, "GET", "/admin/weights").json()["adapters"])


def _adapter(base: Any, server: ServerProcess, tenant: str, version: int, seed: int) -> Path:
    """An adapter where the trainer of tenant scope writes the tenant's versions."""
    path = server.data_dir / "checkpoints" / "tenants" / tenant / f"v{version}"
    path.parent.mkdir(parents=True, exist_ok=True)
    return make_adapter(base, path, seed, merge=False).path


def _turns(server: ServerProcess) -> list[TurnRecord]:
    client = redis.Redis.from_url(server.redis_url)
    try:
        return list(bus.decode_entries(client.xrange(bus.stream_key(bus.TURNS)), TurnRecord))
    finally:
        client.close()


def _wait_turns(server: ServerProcess, count: int) -> list[TurnRecord]:
    deadline = time.monotonic() + 30
    while len(turns := _turns(server)) < count:
        assert time.monotonic() < deadline, len(turns)
        time.sleep(0.1)
    return turns


def _turn_of(server: ServerProcess, text: str) -> TurnRecord:
    deadline = time.monotonic() + 30
    while True:
        found = [t for t in _turns(server) if t.messages[-1]["content"] == text]
        if found:
            return found[0]
        assert time.monotonic() < deadline, text
        time.sleep(0.1)


async def _collect(server: ServerProcess, turns: list[TurnRecord]) -> list[TrainingBatch]:
    """Judge the turns (a fixed score), run the collector in tenant scope; all batches."""
    client = await bus.connect(server.redis_url)
    try:
        for turn in turns:
            scored = ScoredTurn(**turn.model_dump(), score=0.5, judge="rules")
            await bus.publish(client, bus.SCORED, scored)
        s = load_settings(redis_url=server.redis_url, data_dir=server.data_dir,
                          model="tiny-random", collector=FAST,
                          trainer={"scope": "tenant", "lora": LORA})  # fmt: skip
        collector = Collector(s.shared(), s.collector, client, tenant_scope=True)
        await collector.start()
        for _ in range(4):
            await collector.step(block_ms=20)
            await asyncio.sleep(0.06)
        entries = await client.xrange(bus.stream_key(bus.BATCHES))
        return [bus.decode(f, TrainingBatch) for _id, f in entries]
    finally:
        await client.aclose()


def test_a_tenants_adapter_never_serves_another_tenant(server: ServerProcess, base: Any) -> None:
    base_a, base_b = _replies(server, A), _replies(server, B)
    assert base_a == base_b  # nobody has an adapter: both are served by the base

    _announce(server, _adapter(base, server, A, 3, seed=1), 3, A)
    first_a = _replies(server, A)
    assert first_a != base_a  # A's adapter changes what A is told
    assert _replies(server, B) == base_b  # ...and nothing of what B is told
    headers, _ = _ask(server, B, QUESTIONS[0])
    assert "x-policy-adapter" not in headers and headers["x-policy-version"] == "0"

    _announce(server, _adapter(base, server, A, 5, seed=2), 5, A)  # A's adapter moves on
    second_a = _replies(server, A)
    assert second_a != first_a
    assert _replies(server, B) == base_b

    _announce(server, _adapter(base, server, B, 6, seed=3), 6, B)  # B gets one of its own
    assert _replies(server, B) != base_b
    assert _replies(server, A) == second_a  # B's adapter changes nothing of A's replies
    headers, _ = _ask(server, A, QUESTIONS[0])
    assert headers["x-policy-adapter"] == A and headers["x-policy-version"] == "5"


async def test_a_tenants_turns_never_reach_another_tenants_batches(
    server: ServerProcess,
) -> None:
    already = len(_turns(server))
    for i in range(3):
        for tenant in (A, B):
            await asyncio.to_thread(_ask, server, tenant, f"question {i} of {tenant}")
    await asyncio.to_thread(_ask, server, A, "a side question", {"X-Turn-Type": "side"})
    await asyncio.to_thread(_ask, server, A, "not for training", {"X-LiveLoop-Train": "false"})
    turns = await asyncio.to_thread(_wait_turns, server, already + 7)
    assert not any(t.messages[-1]["content"] == "not for training" for t in _turns(server))
    owner = {t.key: t.tenant for t in turns}
    side = {t.key for t in turns if t.turn_type == "side"}
    assert len(side) == 1

    got = await _collect(server, turns)
    assert {b.tenant for b in got} == {A, B}
    for batch in got:
        assert {owner[s.key] for s in batch.samples or []} == {batch.tenant}
    batched = {s.key for b in got for s in b.samples or []}
    assert not batched & side  # side turns are never trained on
    assert batched == set(owner) - side


async def test_a_deleted_tenant_leaves_nothing_while_others_keep_serving(
    server: ServerProcess, base: Any
) -> None:
    await asyncio.to_thread(_announce, server, _adapter(base, server, A, 8, seed=4), 8, A)
    await asyncio.to_thread(_announce, server, _adapter(base, server, B, 9, seed=5), 9, B)
    headers, _ = await asyncio.to_thread(_ask, server, A, "remember me")
    session_a = headers["x-session-id"]
    await _collect(server, [await asyncio.to_thread(_turn_of, server, "remember me")])
    settings = load_settings(data_dir=server.data_dir)
    with Registry.open(settings.effective_db_url) as reg:
        path = server.data_dir / "checkpoints" / "tenants" / A / "v8"
        reg.add_model_version(8, str(path), None, adapter=A, tenant=A)
        reg.upsert_session(session_a, A)
        reg.record_version_quality(0, served={"judged": 1}, tenant=A)  # the base on A's turns
    await asyncio.to_thread(_ask, server, B, "archived too")
    await _collect(server, [await asyncio.to_thread(_turn_of, server, "archived too")])
    sync = redis.Redis.from_url(server.redis_url, decode_responses=True)
    archive = server.data_dir / "archive"  # where `liveloop serve` was told it is
    writer = ArchiveWriter(archive, bus.stream_key(bus.TURNS))
    writer.add(sync.xrange(bus.stream_key(bus.TURNS)))
    writer.close()
    pipe = sync.pipeline(transaction=False)  # the judging loop's counters of the base, per tenant
    for tenant in (A, B):
        QualityStore.queue_turn(pipe, 0, 0.5, "a judged reply of the base", tenant)
    pipe.execute()
    replies_b = await asyncio.to_thread(_replies, server, B)

    gone = await asyncio.to_thread(_admin, server, "DELETE", f"/admin/tenants/{A}")
    assert gone.status_code == 200, gone.text
    report = gone.json()
    assert report["adapters_unloaded"] == [A] and report["checkpoints"] >= 1
    assert report["registry"]["versions"] == 1 and report["archive_entries"] > 0

    # The streams, read back: nothing of A's (turns, judged turns, batches, announcements).
    for name in (bus.TURNS, bus.SCORED, bus.BATCHES):
        for _id, fields in sync.xrange(bus.stream_key(name)):
            assert A not in fields["data"], name
    # ...but the withdrawal of its adapter, for every other server to unload it too.
    announced = [bus.decode(f, WeightsAnnouncement) for _id, f in sync.xrange("liveloop:weights")]
    mentions = [a for a in announced if A in a.model_dump_json()]
    assert [(a.adapter, a.withdrawn, a.servable) for a in mentions] == [(A, True, False)]
    assert not list(sync.scan_iter(match=f"liveloop:session:{session_a}"))
    assert not list(sync.scan_iter(match=f"liveloop:prefix:{A}:*"))
    assert not list(sync.scan_iter(match=f"liveloop:quality:*{A}*"))
    assert len(list(sync.scan_iter(match=f"liveloop:quality:*{B}*"))) == 2
    baselines = sync.hkeys("liveloop:collector:baselines")  # the collector's, per tenant
    assert not any(n.startswith(A) for n in baselines) and any(n.startswith(B) for n in baselines)
    assert not (server.data_dir / "checkpoints" / "tenants" / A).exists()
    with Registry.open(settings.effective_db_url) as reg:
        assert reg.list_model_versions(tenant=A) == [] and reg.get_session(session_a) is None
        assert [q.version for q in reg.version_quality(A)] == []
    archived = [f for _id, f in Archive(archive).entries(bus.stream_key(bus.TURNS))]
    assert archived and not any(A in str(f["data"]) for f in archived)
    assert any(B in str(f["data"]) for f in archived)  # B's records stay
    sync.close()

    # B is served as before; A by the base, as a tenant that never had an adapter.
    assert await asyncio.to_thread(_replies, server, B) == replies_b
    headers, _ = await asyncio.to_thread(_ask, server, A, QUESTIONS[0])
    assert "x-policy-adapter" not in headers
    assert A not in _served(server) and B in _served(server)
    # B keeps being batched.
    await asyncio.to_thread(_ask, server, B, "still here")
    batches = await _collect(server, [await asyncio.to_thread(_turn_of, server, "still here")])
    assert any(b.tenant == B for b in batches)

    again = await asyncio.to_thread(_admin, server, "DELETE", f"/admin/tenants/{A}")
    assert again.status_code == 200 and again.json()["checkpoints"] == 0  # harmless
    unknown = await asyncio.to_thread(_admin, server, "DELETE", "/admin/tenants/key-000000000000")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"

    # A withdrawal announced by another server's deletion: this one unloads the adapter too.
    withdrawal = WeightsAnnouncement(version=0, path="", kind="adapter", adapter=B, tenant=B,
                                     withdrawn=True, status="rejected")  # fmt: skip
    sync = redis.Redis.from_url(server.redis_url)
    sync.xadd(bus.stream_key(bus.WEIGHTS), {"data": withdrawal.model_dump_json()})
    sync.close()
    deadline = time.monotonic() + 30
    while B in _served(server):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    headers, _ = await asyncio.to_thread(_ask, server, B, QUESTIONS[0])
    assert "x-policy-adapter" not in headers
