"""Adapter versions through a real server: announced on `liveloop:weights`, followed and
served, named in the response headers and the turn records, listed and rolled back one at
a time by the admin API, routed per tenant (a tenant's adapter never serves another)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from liveloop import bus
from liveloop.contracts import TurnRecord, WeightsAnnouncement
from liveloop.models import load_model
from liveloop.server.api.auth import tenant_id
from liveloop.valkey import EmbeddedValkey
from tests.server_proc import ADMIN_KEY, API_KEYS, ServerProcess, keyed_server
from tests.support.adapters import make_adapter

DB = 12


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = load_model("tiny-random").model
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_adapter(base, root / name, seed, merge=False).path
        for name, seed in (("a1", 1), ("a2", 2), ("b1", 3))
    }


@pytest.fixture(scope="module")
def server(
    valkey_server: EmbeddedValkey, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    with keyed_server(valkey_server.url, DB, tmp_path_factory.mktemp("srv")) as proc:
        yield proc


def _admin(server: ServerProcess, method: str, path: str, **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    return httpx.request(method, server.base_url + path, headers=headers, timeout=60, **kw)


def _ask(server: ServerProcess, key: str, text: str) -> tuple[dict[str, str], str]:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-random", messages=[{"role": "user", "content": text}], max_tokens=4,
        temperature=0.0,
    )  # fmt: skip
    reply = raw.parse().choices[0].message.content or ""
    return {k.lower(): v for k, v in raw.headers.items()}, reply


def _announce(
    server: ServerProcess, path: Path, version: int, adapter: str, tenant: str | None = None
) -> None:
    client = redis.Redis.from_url(server.redis_url)
    ann = WeightsAnnouncement(version=version, path=str(path), kind="adapter", adapter=adapter,
                              tenant=tenant)  # fmt: skip
    client.xadd(bus.stream_key(bus.WEIGHTS), {"data": ann.model_dump_json()})
    client.close()


def _served(server: ServerProcess) -> dict[str, Any]:
    return dict(_admin(server, "GET", "/admin/weights").json()["adapters"])


def _wait_served(server: ServerProcess, adapter: str, version: int) -> None:
    deadline = time.monotonic() + 60
    while _served(server).get(adapter, {}).get("version") != version:
        assert time.monotonic() < deadline, _served(server)
        time.sleep(0.1)


def _turn(server: ServerProcess, text: str) -> TurnRecord:
    client = redis.Redis.from_url(server.redis_url)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for turn in bus.decode_entries(client.xrange(bus.stream_key(bus.TURNS)), TurnRecord):
                if turn.messages[-1]["content"] == text:
                    return turn
            time.sleep(0.1)
    finally:
        client.close()
    raise AssertionError(f"no turn recorded for {text!r}")


def test_adapter_versions_are_served_recorded_and_rolled_back_one_at_a_time(
    server: ServerProcess, adapters: dict[str, Path]
) -> None:
    base_headers, base_reply = _ask(server, API_KEYS[1], "Hello there")
    assert "x-policy-adapter" not in base_headers and base_headers["x-policy-version"] == "0"

    _announce(server, adapters["a1"], 3, "shared")  # a shared adapter: everyone's requests
    _wait_served(server, "shared", 3)
    headers, reply = _ask(server, API_KEYS[1], "Hello there")
    assert headers["x-policy-adapter"] == "shared" and headers["x-policy-version"] == "3"
    assert reply != base_reply  # the adapter changes what is said at temperature 0
    turn = _turn(server, "Hello there")
    assert turn.adapter is None and set(turn.versions) == {0}  # the base request's record
    _ask(server, API_KEYS[1], "Hello again")
    turn = _turn(server, "Hello again")
    assert turn.adapter == "shared" and set(turn.versions) == {3}

    # Tenant alpha gets an adapter of its own; beta stays on the shared one.
    alpha = tenant_id(API_KEYS[0])
    _announce(server, adapters["b1"], 4, "alpha-own", tenant=alpha)
    _wait_served(server, "alpha-own", 4)
    assert _ask(server, API_KEYS[0], "Hi")[0]["x-policy-adapter"] == "alpha-own"
    assert _ask(server, API_KEYS[1], "Hi")[0]["x-policy-adapter"] == "shared"
    served = _served(server)
    assert served["alpha-own"] == {"version": 4, "shared": False, "tenants": [alpha]}
    assert served["shared"] == {"version": 3, "shared": True, "tenants": []}

    # A new version of the shared adapter, then its rollback by the admin API: the other
    # adapter is untouched throughout.
    _announce(server, adapters["a2"], 5, "shared")
    _wait_served(server, "shared", 5)
    back = _admin(server, "POST", "/admin/weights",
                  json={"path": str(adapters["a1"]), "version": 3, "adapter": "shared"})  # fmt: skip
    assert back.status_code == 200, back.text
    served = _served(server)
    assert served["shared"]["version"] == 3 and served["alpha-own"]["version"] == 4
    again, again_reply = _ask(server, API_KEYS[1], "Hello there")
    assert again["x-policy-version"] == "3" and again_reply == reply  # a1 answers as before

    # A corrupt adapter is refused; what was served goes on.
    broken = adapters["a2"].parent / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{}")
    refused = _admin(server, "POST", "/admin/weights",
                     json={"path": str(broken), "version": 9, "adapter": "shared"})  # fmt: skip
    assert refused.status_code == 400 and "refused" in refused.json()["error"]["message"]
    assert _served(server)["shared"]["version"] == 3

    # Unloaded: nobody is routed to it any more; an unknown one is a 404.
    assert _admin(server, "DELETE", "/admin/adapters/shared").status_code == 200
    assert "x-policy-adapter" not in _ask(server, API_KEYS[1], "Hi")[0]
    missing = _admin(server, "DELETE", "/admin/adapters/shared")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
