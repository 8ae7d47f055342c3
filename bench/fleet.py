"""The four loops as separate processes on one Valkey: what fault and load runs drive.

Why: crash recovery can only be shown on real processes. `Fleet` starts an embedded Valkey
of its own (so a run may stop, restart or wipe it) and `liveloop serve | judge | collect |
train` as child processes on one data dir, each with its log file, and lets a run SIGKILL,
restart or stop any of them. Settings go to every loop as `LIVELOOP_*` variables, so a run
states them in one dict. Used by `bench/faults.py`, `bench/load.py` and the fault tests.

Children are asked to die with their parent (PR_SET_PDEATHSIG), which Linux ties to the
*thread* that forked them: every child is therefore started from one spawner thread that
lives as long as the fleet, whichever thread asks for the (re)start.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from liveloop.children import die_with_parent, stop_process
from liveloop.valkey import EmbeddedValkey, free_port

ROOT = Path(__file__).resolve().parent.parent
LOOPS = ("serve", "judge", "collect", "train")


def settings_env(config: dict[str, Any], prefix: str = "LIVELOOP_") -> dict[str, str]:
    """`LIVELOOP_*` variables for a nested settings dict (sections joined with `__`)."""
    env: dict[str, str] = {}
    for key, value in config.items():
        name = prefix + key.upper()
        if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
            if key in ("judges",):  # a dict-valued setting, not a section
                env[name] = json.dumps(value)
                continue
            env.update(settings_env(value, name + "__"))
        elif isinstance(value, (list, dict, bool)) or value is None:
            env[name] = json.dumps(value)
        else:
            env[name] = str(value)
    return env


@dataclass
class Loop:
    """One loop process: its command, the process now running, and its history."""

    name: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0
    started_at: float = 0.0
    kills: list[dict[str, Any]] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        """Whether the process is running."""
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int:
        """The running process's id (0 when none)."""
        return self.process.pid if self.process is not None else 0


class Fleet:
    """Valkey + the loops as child processes on tiny-random (or another model)."""

    def __init__(
        self,
        root: Path,
        config: dict[str, Any] | None = None,
        *,
        model: str = "tiny-random",
        loops: tuple[str, ...] = LOOPS,
        env: dict[str, str] | None = None,
    ) -> None:
        self.root = Path(root)
        self.data_dir = self.root / "data"
        self.model = model
        self.port = free_port()
        self.valkey = EmbeddedValkey(self.root, port=free_port())
        self.env = self._environment(config or {}, env or {})
        self.loops = {name: self._loop(name) for name in loops}
        self._spawns: queue.Queue[tuple[Callable[[], Any], Future[Any]] | None] = queue.Queue()
        self._spawner: threading.Thread | None = None

    def _spawn_loop(self) -> None:
        while (item := self._spawns.get()) is not None:
            fn, done = item
            try:
                done.set_result(fn())
            except BaseException as exc:
                done.set_exception(exc)

    def spawn(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` (which starts child processes) on the spawner thread; its result."""
        if self._spawner is None or not self._spawner.is_alive():
            self._spawner = threading.Thread(target=self._spawn_loop, daemon=True, name="spawner")
            self._spawner.start()
        done: Future[Any] = Future()
        self._spawns.put((fn, done))
        return done.result()

    def start_valkey(self) -> None:
        """(Re)start the fleet's Valkey on its port."""
        self.spawn(self.valkey.start)

    @property
    def redis_url(self) -> str:
        """URL of the fleet's Valkey."""
        return self.valkey.url

    @property
    def base_url(self) -> str:
        """http://127.0.0.1:<port> of the serving loop."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def checkpoints_dir(self) -> Path:
        """Where the trainer writes checkpoints."""
        return self.data_dir / "checkpoints"

    def _environment(self, config: dict[str, Any], extra: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LIVELOOP_")}
        env.update({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
        env["TOKENIZERS_PARALLELISM"] = "false"
        if "LIVELOOP_CACHE_DIR" in os.environ:
            env["LIVELOOP_CACHE_DIR"] = os.environ["LIVELOOP_CACHE_DIR"]
        env.update(settings_env(config))
        env.update(extra)
        return env

    def _loop(self, name: str) -> Loop:
        argv = [sys.executable, "-m", "liveloop.cli", name, "--model", self.model]
        argv += ["--data-dir", str(self.data_dir), "--redis-url", self.valkey.url]
        argv += ["--log-level", "INFO", "--host", "127.0.0.1"]
        argv += ["--port", str(self.port)] if name == "serve" else []
        argv += [] if name == "serve" else ["--metrics-port", str(free_port())]
        return Loop(name, argv, self.root / "logs" / f"{name}.log")

    def metrics_url(self, name: str) -> str:
        """Where a loop serves its Prometheus metrics."""
        if name == "serve":
            return self.base_url + "/metrics"
        argv = self.loops[name].argv
        return f"http://127.0.0.1:{argv[argv.index('--metrics-port') + 1]}/metrics"

    # -- life cycle -------------------------------------------------------------------

    def start(self, ready_timeout_s: float = 180.0) -> Fleet:
        """Start Valkey and every loop; returns once the server answers /readyz."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.start_valkey()
        for name in self.loops:
            self.start_loop(name)
        if "serve" in self.loops:
            self.wait_ready(ready_timeout_s)
        return self

    def start_loop(self, name: str) -> None:
        """Start (or restart) one loop, its output appended to its log."""
        self.spawn(lambda: self._start_loop(name))

    def _start_loop(self, name: str) -> None:
        loop = self.loops[name]
        loop.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(loop.log_path, "ab") as out:
            loop.process = subprocess.Popen(
                loop.argv,
                env=self.env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
            )
        loop.starts += 1
        loop.started_at = time.monotonic()

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Wait until the server's /readyz answers 200 (raises with its log otherwise)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            serve = self.loops["serve"]
            if not serve.alive:
                raise RuntimeError(f"serve exited:\n{self.log_tail('serve')}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/readyz", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"serve not ready after {timeout_s:.0f}s:\n{self.log_tail('serve')}")

    def kill(self, name: str, phase: str = "random") -> int:
        """SIGKILL one loop (and wait for it); returns the killed process id."""
        loop = self.loops[name]
        proc = loop.process
        if proc is None or proc.poll() is not None:
            return 0
        children = _children(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for child in children:  # e.g. the engine worker of `serve`: gone with its parent
            with contextlib.suppress(psutil.Error):
                child.kill()
        loop.kills.append({"pid": proc.pid, "phase": phase, "at": time.monotonic()})
        return proc.pid

    def stop_loop(self, name: str, timeout_s: float = 20.0) -> int | None:
        """SIGTERM one loop (a clean stop), SIGKILL after `timeout_s`; its exit status."""
        proc = self.loops[name].process
        if proc is None:
            return None
        return stop_process(proc, timeout_s)

    def stop(self) -> dict[str, int | None]:
        """Stop every loop (server last: it flushes its trace queue), then Valkey."""
        codes = {name: self.stop_loop(name) for name in self.loops if name != "serve"}
        if "serve" in self.loops:
            codes["serve"] = self.stop_loop("serve")
        self.valkey.stop()
        if self._spawner is not None:  # nothing of ours is left running: let it end
            self._spawns.put(None)
            self._spawner.join()
            self._spawner = None
        return codes

    def log_tail(self, name: str, chars: int = 4000) -> str:
        """The end of a loop's log."""
        try:
            return self.loops[name].log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def rss_mb(self) -> dict[str, float]:
        """Resident memory of each live loop with its children (the engine worker), in MiB."""
        out: dict[str, float] = {}
        for name, loop in self.loops.items():
            if not loop.alive:
                continue
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(loop.pid)
                total = proc.memory_info().rss
                total += sum(c.memory_info().rss for c in proc.children(recursive=True))
                out[name] = total / 2**20
        with contextlib.suppress(psutil.Error):
            if self.valkey.process is not None:
                out["valkey"] = psutil.Process(self.valkey.process.pid).memory_info().rss / 2**20
        return out

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()


def _children(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return list(psutil.Process(pid).children(recursive=True))
    return []


@contextlib.contextmanager
def running(fleet: Fleet) -> Iterator[Fleet]:
    """Start a fleet and stop it whatever happens."""
    try:
        yield fleet.start()
    finally:
        fleet.stop()
