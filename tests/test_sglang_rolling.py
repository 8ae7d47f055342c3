"""Weight updates and failures across two real SGLang replicas behind the gateway.

A live rolling update from a checkpoint the real trainer wrote (from turns this gateway
recorded) while streams are in flight; a corrupt checkpoint; a replica that cannot load
a checkpoint (kept out, retried with backoff); a rollback through `POST /admin/weights`;
and a replica killed with SIGKILL. The kill comes last: the next module restarts it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from liveloop.contracts import BatchSample, WeightsAnnouncement
from liveloop.models import resolve_model_dir
from liveloop.server.engine.sglang.pool import HashRing, Replica
from tests.conftest import wait_until
from tests.server_proc import ADMIN_KEY, API_KEYS, REPO_ROOT, ServerProcess, db_url, wait_for_turns
from tests.support.sglang import MODEL, SGLangServers

pytest_plugins = ["tests.sglang_fixtures"]
pytestmark = pytest.mark.sglang

GATEWAY_DB, TRAINER_DB, ABORT_DB = 12, 13, 15
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rolling")
    return {"root": root, "written": root / "written", "seen": root / "seen"}


@pytest.fixture(scope="module")
def gateway(
    sglang_servers: SGLangServers, valkey_server: Any, paths: dict[str, Path]
) -> Iterator[ServerProcess]:
    sglang_servers.ensure_running()
    url = db_url(valkey_server.url, GATEWAY_DB)
    redis.Redis.from_url(url).flushdb()
    env = {
        "LIVELOOP_API_KEYS": ",".join(API_KEYS),
        "LIVELOOP_ADMIN_KEY": ADMIN_KEY,
        "LIVELOOP_SERVER__SGLANG__HEALTH_INTERVAL_S": "0.5",
        "LIVELOOP_SERVER__SGLANG__HEALTH_FAILURES": "2",
        "LIVELOOP_SERVER__SGLANG__RETRY_BACKOFF_S": "[1.0, 2.0]",
        # Checkpoints written under `written` are where the replicas see them under `seen`.
        "LIVELOOP_SERVER__SGLANG__PATH_MAP": json.dumps(
            {str(paths["written"]): str(paths["seen"])}
        ),
    }
    args = ["--engine", "sglang", "--sglang-url", ",".join(sglang_servers.urls)]
    server = ServerProcess(url, paths["root"] / "gw", env=env, model=MODEL, extra_args=args)
    server.start(timeout_s=180)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def trained(gateway: ServerProcess, valkey_server: Any, paths: dict[str, Path]) -> Path:
    """A checkpoint the real trainer wrote from turns this gateway served."""
    client = redis.Redis.from_url(gateway.redis_url, decode_responses=True)
    try:
        return train_checkpoint(gateway, client, valkey_server.url, paths["root"] / "trainer")
    finally:
        client.close()


@pytest.fixture
def rdb(gateway: ServerProcess) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(gateway.redis_url, decode_responses=True)
    yield client
    client.close()


def client_of(gateway: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=API_KEYS[0], max_retries=0)


def replicas(gateway: ServerProcess) -> list[dict[str, Any]]:
    body = httpx.get(gateway.base_url + "/readyz", timeout=10).json()
    return list(body.get("replicas", []))


def sessions_per_replica(gateway: ServerProcess, per_replica: int, tag: str) -> list[str]:
    """Session ids whose replica (consistent hashing) covers each replica `per_replica` times."""
    urls = [r["url"] for r in replicas(gateway)]
    ring = HashRing([Replica(u, None) for u in urls])  # type: ignore[arg-type]
    chosen: dict[str, list[str]] = {u: [] for u in urls}
    i = 0
    while any(len(v) < per_replica for v in chosen.values()):
        session = f"{tag}-{i}"
        owner = next(ring.walk(session)).url
        if len(chosen[owner]) < per_replica:
            chosen[owner].append(session)
        i += 1
    return [s for group in chosen.values() for s in group]


def train_checkpoint(gateway: ServerProcess, rdb: redis.Redis, valkey_url: str, out: Path) -> Path:
    """Turns served by the gateway -> one batch -> the real trainer -> its checkpoint."""
    client = client_of(gateway)
    for i in range(3):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Say something about {i}."}],
            max_tokens=8,
            extra_headers={"X-Session-Id": f"train-{i}"},
        )
    samples = []
    for i in range(3):
        [turn] = wait_for_turns(rdb, f"train-{i}", 1)
        samples.append(BatchSample(
            key=f"train-{i}:0:0", prompt_token_ids=turn["prompt_token_ids"],
            completion_token_ids=turn["completion_token_ids"], logprobs=turn["logprobs"],
            versions=turn["versions"], advantage=1.0 if i % 2 else -1.0, score=0.0,
        ).model_dump())  # fmt: skip
    samples_file = out / "samples.json"
    out.mkdir(parents=True, exist_ok=True)
    samples_file.write_text(json.dumps(samples))
    trainer_redis = db_url(valkey_url, TRAINER_DB)
    redis.Redis.from_url(trainer_redis).flushdb()
    cmd = [sys.executable, "-m", "tests.support.train_once", trainer_redis, str(out / "data"),
           MODEL, str(samples_file)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoint = Path(done.stdout.strip().splitlines()[-1])
    assert (checkpoint / "config.json").is_file() and (checkpoint / "model.safetensors").is_file()
    return checkpoint


async def stream_one(gateway: ServerProcess, session: str, started: asyncio.Event) -> str:
    async with openai.AsyncOpenAI(
        base_url=gateway.base_url + "/v1", api_key=API_KEYS[0], max_retries=0
    ) as client:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me a long story about the sea."}],
            max_tokens=40,
            stream=True,
            extra_body={"ignore_eos": True},
            extra_headers={"X-Session-Id": session},
        )
        finish = ""
        async for chunk in stream:
            started.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        return finish


async def streams_during_announcement(
    gateway: ServerProcess, rdb: redis.Redis, sessions: list[str], checkpoint: Path
) -> list[str]:
    events = [asyncio.Event() for _ in sessions]
    tasks = [
        asyncio.create_task(stream_one(gateway, s, e))
        for s, e in zip(sessions, events, strict=True)
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 300)
    announcement = WeightsAnnouncement(version=1, path=str(checkpoint), parent=0)
    rdb.xadd("liveloop:weights", {"data": announcement.model_dump_json()})
    return list(await asyncio.gather(*tasks))


def test_live_rolling_update_from_a_trainer_checkpoint(
    gateway: ServerProcess, rdb: redis.Redis, trained: Path
) -> None:
    sessions = sessions_per_replica(gateway, 2, "roll")
    finishes = asyncio.run(streams_during_announcement(gateway, rdb, sessions, trained))
    assert finishes == ["length"] * len(sessions), "every stream in flight must finish"
    wait_until(lambda: all(r["version"] == 1 and r["in_pool"] for r in replicas(gateway)),
               180, "both replicas on version 1")  # fmt: skip
    spanning = 0
    for session in sessions:
        [record] = wait_for_turns(rdb, session, 1)
        versions = record["versions"]
        assert len(versions) == len(record["completion_token_ids"]) == 40
        assert versions == sorted(versions), f"versions went backwards: {versions}"
        spanning += versions[0] == 0 and versions[-1] == 1
    assert spanning >= 1, "no stream saw the update happen while it was in flight"
    raw = client_of(gateway).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert raw.headers["x-policy-version"] == "1"


def test_a_corrupt_checkpoint_is_refused_and_serving_goes_on(
    gateway: ServerProcess, paths: dict[str, Path]
) -> None:
    corrupt = paths["root"] / "corrupt"
    shutil.copytree(resolve_model_dir(MODEL), corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 64)
    answer = httpx.post(gateway.base_url + "/admin/weights", headers=ADMIN, timeout=60,
                        json={"path": str(corrupt), "version": 2})  # fmt: skip
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_checkpoint"
    assert all(r["in_pool"] and r["version"] == 1 for r in replicas(gateway))
    reply = client_of(gateway).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "still there?"}], max_tokens=3
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_a_replica_that_cannot_load_stays_out_and_is_retried(
    gateway: ServerProcess, paths: dict[str, Path]
) -> None:
    written = paths["written"] / "v2"
    shutil.copytree(resolve_model_dir(MODEL), written)  # valid here, absent where SGLang looks
    answer = httpx.post(gateway.base_url + "/admin/weights", headers=ADMIN, timeout=120,
                        json={"path": str(written), "version": 2})  # fmt: skip
    assert answer.status_code == 400, answer.text
    states = replicas(gateway)
    out = [r for r in states if not r["in_pool"]]
    assert len(out) == 1 and out[0]["state"] == "failed" and out[0]["version"] == 1
    assert [r["version"] for r in states if r["in_pool"]] == [1]
    for i in range(3):  # served by the other replica meanwhile
        client_of(gateway).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            extra_headers={"X-Session-Id": f"out-{i}"},
        )  # fmt: skip
    failed = [
        float(line.rsplit(" ", 1)[1])
        for line in httpx.get(gateway.base_url + "/metrics").text.splitlines()
        if line.startswith("liveloop_sglang_replica_weight_updates_total{")
        and 'outcome="failed"' in line
    ]
    assert sum(failed) >= 1
    staged = paths["seen"] / ".v2-staging"  # the shared volume catches up (atomically)
    shutil.copytree(written, staged)
    staged.rename(paths["seen"] / "v2")
    wait_until(lambda: all(r["version"] == 2 and r["in_pool"] for r in replicas(gateway)),
               120, "the retry to bring both replicas to version 2")  # fmt: skip


def test_rollback_through_admin(gateway: ServerProcess) -> None:
    base = str(resolve_model_dir(MODEL))
    answer = httpx.post(gateway.base_url + "/admin/weights", headers=ADMIN, timeout=120,
                        json={"path": base, "version": 0})  # fmt: skip
    assert answer.status_code == 200, answer.text
    assert answer.json()["version"] == 0
    assert all(r["version"] == 0 and r["in_pool"] for r in replicas(gateway))


def test_abort_mode_continues_in_flight_streams_on_the_other_replica(
    sglang_servers: SGLangServers, valkey_server: Any, paths: dict[str, Path], trained: Path
) -> None:
    """pause_mode 'abort': a paused replica ends its requests at once; the gateway continues
    each from the tokens it had on the replica still serving, so none fails."""
    url = db_url(valkey_server.url, ABORT_DB)
    redis.Redis.from_url(url).flushdb()
    env = {
        "LIVELOOP_API_KEYS": ",".join(API_KEYS),
        "LIVELOOP_ADMIN_KEY": ADMIN_KEY,
        "LIVELOOP_SERVER__SGLANG__PAUSE_MODE": "abort",
    }
    args = ["--engine", "sglang", "--sglang-url", ",".join(sglang_servers.urls)]
    aborting = ServerProcess(url, paths["root"] / "gw-abort", env=env, model=MODEL, extra_args=args)
    aborting.start(timeout_s=180)
    try:
        sessions = sessions_per_replica(aborting, 2, "abort")

        async def streams_during_update() -> tuple[list[str], httpx.Response]:
            events = [asyncio.Event() for _ in sessions]
            tasks = [asyncio.create_task(stream_one(aborting, s, e))
                     for s, e in zip(sessions, events, strict=True)]  # fmt: skip
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 300)
            answer = await asyncio.to_thread(httpx.post, aborting.base_url + "/admin/weights",
                json={"path": str(trained), "version": 7}, headers=ADMIN, timeout=300)  # fmt: skip
            return list(await asyncio.gather(*tasks)), answer

        finishes, answer = asyncio.run(streams_during_update())
        assert answer.status_code == 200, answer.text
        assert finishes == ["length"] * len(sessions), "every stream in flight must finish"
        client = redis.Redis.from_url(url, decode_responses=True)
        for session in sessions:
            [record] = wait_for_turns(client, session, 1)
            assert len(record["completion_token_ids"]) == len(record["logprobs"]) == 40
            assert record["versions"] == sorted(record["versions"])
        client.close()
        assert all(r["version"] == 7 and r["in_pool"] for r in replicas(aborting))
    finally:
        aborting.stop()


def test_a_killed_replica_moves_its_sessions_and_in_flight_streams(
    gateway: ServerProcess, rdb: redis.Redis, sglang_servers: SGLangServers
) -> None:
    if sglang_servers.external:
        pytest.skip("servers reused from LIVELOOP_SGLANG_TEST_URLS cannot be killed here")
    [session, _other] = sessions_per_replica(gateway, 1, "kill")
    victim = sglang_servers.urls.index(
        next(HashRing([Replica(u, None) for u in sglang_servers.urls]).walk(session)).url  # type: ignore[arg-type]
    )

    async def stream_and_kill() -> str:
        started = asyncio.Event()
        task = asyncio.create_task(stream_one(gateway, session, started))
        await asyncio.wait_for(started.wait(), 300)
        await asyncio.to_thread(sglang_servers.kill, victim)
        return await task

    assert asyncio.run(stream_and_kill()) == "length", "the in-flight stream must continue"
    [record] = wait_for_turns(rdb, session, 1)
    assert len(record["completion_token_ids"]) == len(record["logprobs"]) == 40
    for turn in range(2):  # the session goes on, on the other replica
        reply = client_of(gateway).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"again {turn}"}], max_tokens=3,
            extra_headers={"X-Session-Id": session},
        )  # fmt: skip
        assert reply.choices[0].finish_reason in ("stop", "length")
    states = {r["url"]: r for r in replicas(gateway)}
    assert not states[sglang_servers.urls[victim]]["healthy"]
    assert states[sglang_servers.urls[1 - victim]]["in_pool"]
