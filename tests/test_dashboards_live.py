"""Every dashboard panel query returns data from a real Prometheus scraping the four loops.

The four loops run as separate `liveloop` processes on tiny-random against the test Valkey;
a real Prometheus (Debian's package) scrapes them every second and loads the alert rules.
Traffic goes through the official openai client: multi-turn sessions (judged by their
next turn), a side turn, explicit feedback, a bad request, a refused checkpoint (admin
API) and a malformed stream entry (dead-lettered), until the trainer publishes a version
and the server serves it. Then every panel query is evaluated through the HTTP API.

Panels that cannot fill here: the per-tenant ones (`TENANT_PANELS`), exported by the trainer
in tenant scope only; the stack runs shared scope (tests/test_tenant_scope.py reads those
metrics). (Judge failures show 0 per judge: the rules judge does not fail on valid turns,
and the count starts at 0.)
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml
from openai import OpenAI

from liveloop.valkey import free_port
from tests.conftest import wait_until
from tests.dashboards import RULES, panel_queries
from tests.ops_tools import REPO_ROOT, tool
from tests.server_proc import ADMIN_KEY

LOOPS = ("serve", "judge", "collect", "train")
TENANT_PANELS = frozenset(
    {"Reward per tenant", "Adapter version per tenant", "Refusals and rollbacks per tenant"}
)
LOOP_ENV = {
    "LIVELOOP_PRM__NEXT_STATE_TIMEOUT_S": "2",
    "LIVELOOP_COLLECTOR__MIN_TURNS": "4",
    "LIVELOOP_COLLECTOR__MAX_WAIT_S": "2",
    "LIVELOOP_TRAINER__QUALITY_INTERVAL_S": "1",
    "LIVELOOP_ADMIN_KEY": ADMIN_KEY,
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONPATH": str(REPO_ROOT),
}


class Stack:
    """The four loops as processes, and a Prometheus scraping them."""

    def __init__(self, redis_url: str, root: Path) -> None:
        self.redis_url = redis_url
        self.root = root
        self.ports = {loop: free_port() for loop in (*LOOPS, "prometheus")}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start_loops(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LIVELOOP_")}
        env.update(LOOP_ENV)
        for loop in LOOPS:
            args = [sys.executable, "-m", "liveloop.cli", loop, "--model", "tiny-random"]
            args += ["--redis-url", self.redis_url, "--data-dir", str(self.root / "data")]
            args += ["--host", "127.0.0.1", "--log-level", "WARNING"]
            flag = "--port" if loop == "serve" else "--metrics-port"
            args += [flag, str(self.ports[loop])]
            with open(self.root / f"{loop}.log", "wb") as log:
                self.procs[loop] = subprocess.Popen(args, env=env, stdout=log, stderr=log)

    def start_prometheus(self) -> None:
        jobs = [
            {
                "job_name": f"liveloop-{loop}",
                "static_configs": [{"targets": [f"127.0.0.1:{self.ports[loop]}"]}],
            }
            for loop in LOOPS
        ]
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": jobs,
        }
        (self.root / "prometheus.yml").write_text(yaml.safe_dump(config))
        args = [tool("prometheus"), f"--config.file={self.root / 'prometheus.yml'}"]
        args += [f"--storage.tsdb.path={self.root / 'tsdb'}"]
        args += [f"--web.listen-address=127.0.0.1:{self.ports['prometheus']}"]
        with open(self.root / "prometheus.log", "wb") as log:
            self.procs["prometheus"] = subprocess.Popen(args, stdout=log, stderr=log)
        wait_until(
            lambda: self._get("/-/ready") is not None, 30, "Prometheus ready", interval_s=0.5
        )

    def _get(self, path: str, **params: str) -> Any:
        try:
            response = httpx.get(self.prometheus + path, params=params, timeout=10)
        except httpx.HTTPError:
            return None
        return response.json() if path.startswith("/api") else response.is_success or None

    @property
    def prometheus(self) -> str:
        return f"http://127.0.0.1:{self.ports['prometheus']}"

    @property
    def server(self) -> str:
        return f"http://127.0.0.1:{self.ports['serve']}"

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (or scalar as a one-sample list)."""
        body = self._get("/api/v1/query", query=expr)
        assert body is not None and body["status"] == "success", (expr, body)
        data = body["data"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def check_alive(self) -> None:
        dead = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
        logs = {n: (self.root / f"{n}.log").read_text(errors="replace")[-2000:] for n in dead}
        assert not dead, f"exited: {dead}\n{logs}"

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def stack(redis_url: str, tmp_path: Path) -> Iterator[Stack]:
    tool("prometheus")
    running = Stack(redis_url, tmp_path)
    try:
        running.start_loops()
        running.start_prometheus()
        yield running
    finally:
        running.stop()


def finite(samples: list[dict[str, Any]]) -> list[float]:
    return [float(s["value"][1]) for s in samples if math.isfinite(float(s["value"][1]))]


def send_traffic(stack: Stack, redis_url: str) -> None:
    """Judged sessions, a side turn, feedback, a bad request, a refused checkpoint, a DLQ."""
    client = OpenAI(base_url=stack.server + "/v1", api_key="none", max_retries=0)
    replies = ["Thanks, that's exactly it.", "No, that's wrong.", "Tell me more."]
    for i in range(6):
        session = {"X-Session-Id": f"dash-{i}"}
        messages: list[Any] = [{"role": "user", "content": f"Question number {i}?"}]
        for reply in replies[: 2 + i % 2]:
            answer = client.chat.completions.create(
                model="tiny-random", messages=messages, max_tokens=6, extra_headers=session
            )
            messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                         {"role": "user", "content": reply}]  # fmt: skip
    stream = client.chat.completions.create(
        model="tiny-random", messages=[{"role": "user", "content": "stream"}], max_tokens=6,
        stream=True, extra_headers={"X-Turn-Type": "side"},
    )  # fmt: skip
    assert sum(1 for _ in stream) > 0
    feedback = {"session_id": "dash-0", "score": 1.0}
    assert httpx.post(stack.server + "/v1/feedback", json=feedback).status_code == 200
    bad = httpx.post(stack.server + "/v1/chat/completions", json={"model": "x", "messages": []})
    assert bad.status_code == 400
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    refused = httpx.post(stack.server + "/admin/weights", headers=admin,
                         json={"path": str(stack.root / "no-such-checkpoint"), "version": 7})  # fmt: skip
    assert refused.status_code == 400
    bus = redis.Redis.from_url(redis_url)
    bus.xadd("liveloop:turns", {"data": "{not json"})
    bus.close()


@pytest.mark.slow
def test_every_panel_query_returns_data_from_the_running_loops(
    stack: Stack, redis_url: str
) -> None:
    ready = f"{stack.server}/readyz"

    def server_ready() -> bool:
        stack.check_alive()
        try:
            return httpx.get(ready, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(server_ready, 180, "the server to be ready", interval_s=0.5)
    send_traffic(stack, redis_url)

    def new_version_served() -> bool:
        stack.check_alive()
        return bool(finite(stack.query("min(liveloop_policy_version) >= 1")))

    wait_until(new_version_served, 240, "a trained version served and scraped", interval_s=0.5)
    wait_until(lambda: finite(stack.query("max(liveloop_stream_dead_letters) >= 1")), 60,
               "the malformed entry dead-lettered", interval_s=0.5)  # fmt: skip
    time.sleep(3)  # a few more scrapes after the last events

    targets = stack.query('up{job=~"liveloop-.*"} == 1')
    assert {t["metric"]["job"] for t in targets} == {f"liveloop-{loop}" for loop in LOOPS}
    queries = [q for q in panel_queries() if q.panel not in TENANT_PANELS]
    empty = [q.name for q in queries if not finite(stack.query(q.promql))]
    assert empty == [], "panel queries without data:\n  " + "\n  ".join(empty)

    refused = finite(stack.query('sum(liveloop_weight_swaps_total{outcome="refused"})'))
    assert refused == [1.0]
    assert finite(stack.query("sum(liveloop_weight_checkpoint_to_serving_seconds_count)"))[0] >= 1
    rewards = stack.query("sum by (version) (liveloop_collector_reward_count)")
    assert "0" in {r["metric"]["version"] for r in rewards}
    groups = stack.query("max by (stream, group) (liveloop_stream_group_lag)")
    assert {("turns", "prm"), ("scored", "collector"), ("batches", "trainer")} <= {
        (g["metric"]["stream"], g["metric"]["group"]) for g in groups
    }
    rules = stack._get("/api/v1/rules")
    health = {r["name"]: r["health"] for g in rules["data"]["groups"] for r in g["rules"]}
    assert len(health) == 9 and set(health.values()) == {"ok"}, health
