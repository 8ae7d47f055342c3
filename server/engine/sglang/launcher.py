"""`--launch N`: local SGLang servers started, watched and stopped by the gateway.

Each server is `python -m sglang.launch_server` on the served model's directory, in a
process group of its own (SGLang starts scheduler and detokenizer children; stopping the
group stops them all) that also dies with the gateway. GPU by default; with
`device = "cpu"` it gets SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1`, `--device cpu`,
torch_native attention, float32, sleep on idle). With `enable_lora` it also gets SGLang's
multi-LoRA flags (`--enable-lora` and its limits). A server that exits on its own is started
again on the same port with backoff; the pool's health checks see it come back and the
rolling updater brings it to the served version before it takes requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from liveloop.children import die_with_parent
from liveloop.config import ConfigError, SGLangConfig
from liveloop.valkey import free_port

log = logging.getLogger(__name__)

CPU_DEFAULTS = (
    ("--attention-backend", "torch_native"),
    ("--dtype", "float32"),
    ("--sleep-on-idle", None),
)
RESTART_BACKOFF_S = (1.0, 60.0)
STOP_TIMEOUT_S = 20.0


def launch_command(python: str, model_dir: str, port: int, cfg: SGLangConfig) -> list[str]:
    """The command line of one server."""
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model_dir]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--incremental-streaming-output"]
    extra = list(cfg.launch_args)
    if cfg.device != "cuda" and "--device" not in extra:
        cmd += ["--device", cfg.device]
    if cfg.device == "cpu":
        for flag, value in CPU_DEFAULTS:
            if flag not in extra:
                cmd += [flag] if value is None else [flag, value]
    return cmd + lora_flags(cfg, extra) + extra


def lora_flags(cfg: SGLangConfig, extra: list[str]) -> list[str]:
    """SGLang's multi-LoRA flags for `enable_lora` (those `launch_args` do not set)."""
    if not cfg.enable_lora:
        return []
    backend = cfg.lora_backend or ("torch_native" if cfg.device == "cpu" else None)
    flags: list[tuple[str, list[str]]] = [
        ("--enable-lora", []),
        ("--max-loras-per-batch", [str(cfg.max_loras_per_batch)]),
        ("--max-lora-rank", [str(cfg.max_lora_rank)]),
        ("--lora-target-modules", list(cfg.lora_target_modules)),
    ]
    if backend is not None:
        flags.append(("--lora-backend", [backend]))
    out: list[str] = []
    for flag, values in flags:
        if flag not in extra:
            out += [flag, *values]
    return out


def server_env(cfg: SGLangConfig) -> dict[str, str]:
    """The environment of a launched server.

    `SGLANG_RETURN_ORIGINAL_LOGPROB=1`: SGLang then returns log-probs of the model's raw
    distribution, as the torch engine records them and the trainer recomputes them (by
    default it returns them after temperature scaling).
    """
    env = dict(os.environ, SGLANG_RETURN_ORIGINAL_LOGPROB="1")
    if cfg.device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    env.update(cfg.launch_env)
    return env


class LaunchedServer:
    """One SGLang server process (group) on a fixed port."""

    def __init__(
        self, index: int, port: int, command: list[str], env: dict[str, str], log_path: Path
    ):
        self.index = index
        self.port = port
        self.command = command
        self.env = env
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    @property
    def url(self) -> str:
        """Where it listens."""
        return f"http://127.0.0.1:{self.port}"

    def spawn(self) -> None:
        """Start it (on the event loop's thread: it dies with the thread that started it)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(
                self.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        self.started_at = time.monotonic()

    def signal_group(self, sig: int) -> None:
        """Send a signal to the server and its children."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, sig)

    def log_tail(self, chars: int = 2000) -> str:
        """The end of its log, for error messages."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class SGLangLauncher:
    """Starts `cfg.launch` servers, restarts one that dies, stops them all."""

    def __init__(self, model_dir: str, cfg: SGLangConfig, log_dir: Path | None = None) -> None:
        self.model_dir = model_dir
        self.cfg = cfg
        self.python = cfg.python or sys.executable
        self.log_dir = log_dir or Path(".liveloop") / "sglang"
        self.servers: list[LaunchedServer] = []
        self._watch: asyncio.Task[None] | None = None
        self._stopping = False

    async def start(self) -> list[str]:
        """Start every server and wait until all are healthy; their URLs."""
        await asyncio.to_thread(self._check_installed)
        env = server_env(self.cfg)
        for index in range(self.cfg.launch):
            port = self.cfg.launch_port + index if self.cfg.launch_port else free_port()
            command = launch_command(self.python, self.model_dir, port, self.cfg)
            log_path = self.log_dir / f"sglang-{index}.log"
            self.servers.append(LaunchedServer(index, port, command, env, log_path))
        for server in self.servers:
            log.info("starting SGLang server %d on port %d", server.index, server.port)
            server.spawn()
        try:
            await asyncio.gather(*(self._wait_healthy(s) for s in self.servers))
        except BaseException:
            await self.stop()
            raise
        self._watch = asyncio.create_task(self._watch_loop(), name="sglang-launcher")
        return [s.url for s in self.servers]

    def _check_installed(self) -> None:
        probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)"
        result = subprocess.run([self.python, "-c", probe], capture_output=True, check=False)
        if result.returncode != 0:
            raise ConfigError(
                f"--launch needs SGLang in {self.python}: pip install 'liveloop[sglang]' "
                "(or set server.sglang.python to an interpreter that has it)"
            )

    async def _wait_healthy(self, server: LaunchedServer) -> None:
        deadline = time.monotonic() + self.cfg.launch_timeout_s
        async with httpx.AsyncClient(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if server.process is None or server.process.poll() is not None:
                    raise ConfigError(
                        f"SGLang server {server.index} exited while starting:\n{server.log_tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(server.url + "/health")).status_code == 200:
                        return
                await asyncio.sleep(1.0)
        raise ConfigError(f"SGLang server {server.index} not healthy after "
                          f"{self.cfg.launch_timeout_s:.0f}s:\n{server.log_tail()}")  # fmt: skip

    async def _watch_loop(self) -> None:
        backoff = {s.index: RESTART_BACKOFF_S[0] for s in self.servers}
        while not self._stopping:
            await asyncio.sleep(1.0)
            for server in self.servers:
                proc = server.process
                if self._stopping or proc is None or proc.poll() is None:
                    continue
                log.error("SGLang server %d exited (code %s); restarting in %.0fs",
                          server.index, proc.returncode, backoff[server.index])  # fmt: skip
                server.signal_group(signal.SIGKILL)  # children it may have left behind
                await asyncio.sleep(backoff[server.index])
                if time.monotonic() - server.started_at > 300:
                    backoff[server.index] = RESTART_BACKOFF_S[0]
                backoff[server.index] = min(2 * backoff[server.index], RESTART_BACKOFF_S[1])
                if not self._stopping:
                    server.spawn()

    async def stop(self) -> None:
        """SIGTERM every server group, then SIGKILL what is left."""
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        for server in self.servers:
            server.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for server in self.servers:
            proc = server.process
            if proc is None:
                continue
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            server.signal_group(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(proc.wait, 5.0)
