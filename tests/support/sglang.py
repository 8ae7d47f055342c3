"""Real SGLang servers on CPU for `make test-sglang` (test support, not the product).

`make test-sglang` installs SGLang 0.5.23 into `.venv-sglang` and points
`LIVELOOP_SGLANG_PYTHON` at its interpreter; tests marked `sglang` are skipped without
it. The servers run SGLang's CPU engine on smollm2-135m with the `sgl_kernel` CPU shim of
this directory on their `PYTHONPATH` (see `sgl_kernel_cpu_shim/README.md`), started with
the same command line the gateway's `--launch` uses.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

from liveloop.config import SGLangConfig
from liveloop.server.engine.sglang.launcher import LaunchedServer, launch_command, server_env
from liveloop.valkey import free_port

PYTHON_ENV = "LIVELOOP_SGLANG_PYTHON"
# While developing: comma-separated URLs of two SGLang servers already running (started
# with `python -m tests.support.sglang`), reused instead of starting new ones each run.
URLS_ENV = "LIVELOOP_SGLANG_TEST_URLS"
SHIM_DIR = Path(__file__).resolve().parent / "sgl_kernel_cpu_shim"
MODEL = "smollm2-135m"
# Few KV slots: each server keeps ~6.6 GB otherwise spent on an unused cache.
CPU_ARGS = ["--max-total-tokens", "32768", "--max-running-requests", "16"]
START_TIMEOUT_S = 600.0


def sglang_python() -> str | None:
    """The interpreter that has SGLang (set by `make test-sglang`), or None."""
    value = os.environ.get(PYTHON_ENV)
    return value if value and Path(value).exists() else None


def cpu_config(**overrides: object) -> SGLangConfig:
    """SGLang settings for launched servers on this machine's CPU."""
    values: dict[str, object] = {
        "python": sglang_python(),
        "device": "cpu",
        "launch_env": {"PYTHONPATH": str(SHIM_DIR)},
        "launch_args": list(CPU_ARGS),
    }
    values.update(overrides)
    return SGLangConfig.model_validate(values)


class SGLangServers:
    """A few SGLang server processes on free ports; kill, restart and stop them."""

    def __init__(self, count: int, log_dir: Path) -> None:
        from liveloop.models import resolve_model_dir

        self.model_dir = str(resolve_model_dir(MODEL))
        cfg = cpu_config()
        env = server_env(cfg)
        env.pop("OMP_NUM_THREADS", None)  # the test session sets 1 for itself
        self.servers = []
        for index in range(count):
            port = free_port()
            command = launch_command(str(cfg.python), self.model_dir, port, cfg)
            log = log_dir / f"sglang-{index}.log"
            self.servers.append(LaunchedServer(index, port, command, env, log))

    @property
    def external(self) -> bool:
        """True when reusing servers named by `LIVELOOP_SGLANG_TEST_URLS`."""
        return bool(os.environ.get(URLS_ENV))

    @property
    def urls(self) -> list[str]:
        """Base URLs, in order."""
        if self.external:
            return os.environ[URLS_ENV].split(",")
        return [s.url for s in self.servers]

    def start(self) -> SGLangServers:
        """Start all and wait until each answers /health."""
        for server in self.servers:
            server.spawn()
        for server in self.servers:
            self.wait_healthy(server.index)
        return self

    def wait_healthy(self, index: int, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait for one server's /health (RuntimeError with its log if it exits)."""
        server = self.servers[index]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if server.process is None or server.process.poll() is not None:
                raise RuntimeError(f"SGLang server {index} exited:\n{server.log_tail(4000)}")
            try:
                if httpx.get(server.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"SGLang server {index} not healthy:\n{server.log_tail(4000)}")

    def alive(self, index: int) -> bool:
        """Whether the server's process still runs."""
        proc = self.servers[index].process
        return proc is not None and proc.poll() is None

    def kill(self, index: int) -> None:
        """SIGKILL the server and its children (what a crashed machine looks like)."""
        server = self.servers[index]
        server.signal_group(signal.SIGKILL)
        if server.process is not None:
            server.process.wait(30)

    def ensure_running(self) -> None:
        """Restart any server that is gone (after a test killed one)."""
        if self.external:
            return
        for server in self.servers:
            if not self.alive(server.index):
                server.signal_group(signal.SIGKILL)
                server.spawn()
        for server in self.servers:
            self.wait_healthy(server.index)

    def stop(self) -> None:
        """Stop every server (SIGTERM, then SIGKILL)."""
        for server in self.servers:
            server.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + 20.0
        for server in self.servers:
            proc = server.process
            while proc is not None and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            server.signal_group(signal.SIGKILL)
            if proc is not None:
                proc.wait(30)


def main() -> None:
    """`python -m tests.support.sglang`: run two servers until Ctrl-C (for development)."""
    import tempfile

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    servers = SGLangServers(2, Path(tempfile.mkdtemp(prefix="sglang-dev-")))
    servers.start()
    print(f"{URLS_ENV}={','.join(servers.urls)}", flush=True)
    try:
        while True:
            time.sleep(2.0)
            servers.ensure_running()  # restart one a test killed or crashed
    except KeyboardInterrupt:
        pass
    finally:
        servers.stop()


if __name__ == "__main__":
    main()
