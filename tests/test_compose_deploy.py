"""`make test-deploy`: docker-compose.yml run for real, from images built here, then removed.

Starts its own Docker daemon, makes a Debian base image with debootstrap (no registry is
reachable), builds the images from a local wheelhouse, brings the stack up without the
gpu profile and without Grafana (no Grafana image can be had here), sends chat traffic
through the published port with the openai client, and waits for judged turns, a batch,
a new policy version served, the version in PostgreSQL's registry, and Prometheus (the
compose service) scraping all four loops. Then it removes the stack, stops the daemon and
puts the host back: no docker0 bridge, iptables and IP forwarding as before.

Runs only under `make test-deploy` (LIVELOOP_TEST_DEPLOY=1): it needs root, apt-installed
docker.io and debootstrap, ~10 GB of disk and about a quarter of an hour.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from liveloop.valkey import free_port
from tests.conftest import wait_until
from tests.docker_host import DockerDaemon, HostNetwork, running_docker
from tests.ops_tools import REPO_ROOT, tool

pytestmark = [
    pytest.mark.skipif(
        not os.environ.get("LIVELOOP_TEST_DEPLOY"), reason="runs under `make test-deploy`"
    ),
    pytest.mark.timeout(3600),  # building the images alone takes 10-15 minutes on 2 cores
]
SERVICES = ["valkey", "postgres", "prometheus", "serve", "judge", "collect", "train"]
TEST_CONFIG = """
[prm]
next_state_timeout_s = 3.0
[collector]
min_turns = 4
max_wait_s = 3.0
"""


def step(name: str, started: float) -> None:
    print(f"[test-deploy] {name}: {time.monotonic() - started:.0f}s", flush=True)


class Compose:
    """The compose CLI against our daemon, with the test's environment."""

    def __init__(self, daemon: DockerDaemon, work: Path) -> None:
        self.binary = tool("docker-compose")
        secrets = work / "secrets"
        secrets.mkdir()
        (secrets / "api_keys").write_text("sk-deploy-test\n")
        (secrets / "admin_key").write_text("sk-deploy-admin\n")
        (secrets / "db_password").write_text("deploy-test-password\n")
        (work / "liveloop.toml").write_text(TEST_CONFIG)
        self.port, self.prometheus_port = free_port(), free_port()
        self.env = {
            **os.environ,
            "DOCKER_HOST": daemon.host,
            "COMPOSE_PROJECT_NAME": "liveloop-deploy-test",
            "LIVELOOP_BASE_IMAGE": "liveloop-base:test",
            "LIVELOOP_PIP_NO_INDEX": "1",
            "LIVELOOP_PRELOAD_MODELS": "tiny-random",
            "LIVELOOP_MODEL": "tiny-random",
            "LIVELOOP_SECRETS_DIR": str(secrets),
            "LIVELOOP_CONFIG_FILE": str(work / "liveloop.toml"),
            "LIVELOOP_PORT": str(self.port),
            "LIVELOOP_BIND": "127.0.0.1",
            "PROMETHEUS_PORT": str(self.prometheus_port),
        }

    def __call__(self, *args: str, timeout: float = 900) -> str:
        result = subprocess.run(
            [self.binary, *args], env=self.env, cwd=REPO_ROOT, capture_output=True,
            text=True, timeout=timeout,
        )  # fmt: skip
        assert result.returncode == 0, (
            f"compose {args}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
        return result.stdout

    def valkey(self, *command: str) -> str:
        return self("exec", "-T", "valkey", "valkey-cli", *command).strip()


@pytest.fixture
def deployment() -> Iterator[Compose]:
    if os.geteuid() != 0:
        pytest.fail("make test-deploy needs root (dockerd, debootstrap)")
    if reason := running_docker():
        pytest.fail(f"make test-deploy needs a host without Docker running: {reason}")
    network = HostNetwork.snapshot()
    work = Path(tempfile.mkdtemp(prefix="liveloop-deploy-"))
    daemon = DockerDaemon(work / "docker")
    compose: Compose | None = None
    started = time.monotonic()
    try:
        subprocess.run(["bash", "deploy/build-wheelhouse.sh"], cwd=REPO_ROOT, check=True,
                       capture_output=True)  # fmt: skip
        step("wheelhouse", started)
        daemon.start()
        env = {**os.environ, "DOCKER_HOST": daemon.host}
        subprocess.run(["bash", "deploy/base/build-base-image.sh", "liveloop-base:test"],
                       cwd=REPO_ROOT, check=True, env=env)  # fmt: skip
        step("base image (debootstrap)", started)
        compose = Compose(daemon, work)
        compose(
            "build", *[s for s in SERVICES if s in ("valkey", "postgres", "prometheus", "serve")]
        )
        step("images built", started)
        yield compose
    finally:
        if compose is not None:
            subprocess.run([compose.binary, "down", "--volumes", "--rmi", "all", "--remove-orphans"],
                           env=compose.env, cwd=REPO_ROOT, capture_output=True, timeout=300)  # fmt: skip
        daemon.stop()
        network.restore()
        shutil.rmtree(work, ignore_errors=True)
        for wheels in ("deploy/wheels", "deploy/valkey/wheels"):
            for wheel in (REPO_ROOT / wheels).glob("*.whl"):
                wheel.unlink()
        step("torn down", started)
    assert network.differences() == [], "the host is not as it was"
    assert daemon.mounts() == [] and not daemon.root.exists()


def test_compose_stack_learns_and_is_scraped(deployment: Compose) -> None:
    compose = deployment
    started = time.monotonic()
    compose("up", "--detach", "--wait", "--wait-timeout", "600", *SERVICES, timeout=700)
    step("stack healthy", started)
    states = {
        s["Service"]: s["Health"]
        for s in map(json.loads, compose("ps", "--format", "json").splitlines())
    }
    assert states == {s: "healthy" for s in SERVICES}, states
    assert compose.valkey("CONFIG", "GET", "appendonly").split() == ["appendonly", "yes"]

    base = f"http://127.0.0.1:{compose.port}"
    client = OpenAI(base_url=base + "/v1", api_key="sk-deploy-test", max_retries=2)
    with pytest.raises(Exception, match="401"):
        OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
    for i in range(8):
        messages: list[Any] = [{"role": "user", "content": f"Deployment question {i}?"}]
        for reply in ("Thanks, that's exactly it.", "No, that's wrong."):
            answer = client.chat.completions.create(
                model="tiny-random", messages=messages, max_tokens=8,
                extra_headers={"X-Session-Id": f"deploy-{i}"},
            )  # fmt: skip
            messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                         {"role": "user", "content": reply}]  # fmt: skip
    step("traffic sent", started)

    wait_until(lambda: int(compose.valkey("XLEN", "liveloop:scored")) >= 8, 120, "judged turns", 1)
    wait_until(lambda: int(compose.valkey("XLEN", "liveloop:batches")) >= 1, 120, "a batch", 1)
    version = wait_until(
        lambda: (httpx.get(base + "/readyz", timeout=5).json().get("policy_version") or 0), 300,
        "a new policy version served", interval_s=1.0,
    )  # fmt: skip
    assert version >= 1
    step(f"policy version {version} served", started)

    rows = compose("exec", "-T", "postgres", "psql", "-U", "liveloop", "-d", "liveloop", "-tAc",
                   "select version from model_versions order by version")  # fmt: skip
    assert version in [int(v) for v in rows.split()], rows

    prometheus = f"http://127.0.0.1:{compose.prometheus_port}/api/v1/query"

    def scraped() -> set[str]:
        query = {"query": 'up{job=~"liveloop-.*"} == 1'}
        result = httpx.get(prometheus, params=query, timeout=5).json()["data"]["result"]
        return {r["metric"]["job"] for r in result}

    jobs = {f"liveloop-{loop}" for loop in ("serve", "judge", "collect", "train")}
    wait_until(lambda: scraped() == jobs, 120, "Prometheus scraping the four loops", 1)

    def scraped_version() -> float:
        query = {"query": "max(liveloop_policy_version)"}
        result = httpx.get(prometheus, params=query, timeout=5).json()["data"]["result"]
        return float(result[0]["value"][1]) if result else 0.0

    wait_until(lambda: scraped_version() >= 1, 120, "Prometheus seeing the new version", 1)
    step("checks done", started)
