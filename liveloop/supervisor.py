"""`liveloop up`: the four loops as child processes, restarted with backoff, stopped together.

Each loop runs in its own process (`python -m liveloop.cli <loop>`), so one crashing does
not take the others down; a crashed loop is restarted with exponential backoff and
reported. Children die with the supervisor (PR_SET_PDEATHSIG), and one Ctrl-C or SIGTERM
stops everything within seconds.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from liveloop.children import die_with_parent
from liveloop.config import LiveLoopSettings
from liveloop.valkey import EmbeddedValkey

log = logging.getLogger(__name__)

LOOPS = ("serve", "judge", "collect", "train")
STOP_GRACE_S = 8.0
MAX_BACKOFF_S = 30.0


def _child_setup() -> None:  # runs in the child between fork and exec
    die_with_parent()
    os.setpgrp()  # a terminal Ctrl-C reaches the supervisor only; it stops children in order


def last_log_line(path: Path, tail_bytes: int = 8192, width: int = 240) -> str:
    """The last non-empty line of a loop's log (its error, when it crashed), shortened."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return ""
    last = lines[-1]
    return last if len(last) <= width else last[: width - 3] + "..."


def exit_reason(code: int | None, log_path: Path) -> str:
    """Why a loop ended: the signal that killed it, else its log's last line after an error."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return last_log_line(log_path) if code else ""


@dataclass
class LoopProcess:
    """One supervised loop: its command, process, restart count and backoff state."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    next_start: float = 0.0
    started_at: float = 0.0
    last_exit: int | None = None
    history: list[str] = field(default_factory=list)

    def start(self) -> None:
        """Start (or restart) the process, its output appended to its log file."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=_child_setup,
            )
        self.started_at = time.monotonic()

    @property
    def alive(self) -> bool:
        """Whether the process is running."""
        return self.process is not None and self.process.poll() is None


class Supervisor:
    """Starts the embedded Valkey (unless a Redis URL is given) and the loops; keeps them up."""

    def __init__(
        self,
        settings: LiveLoopSettings,
        *,
        config_files: list[Path] | None = None,
        loops: tuple[str, ...] = LOOPS,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.settings = settings
        self.config_files = list(config_files or [])
        self.loop_names = loops
        self.extra_env = extra_env or {}
        self.valkey: EmbeddedValkey | None = None
        self.redis_url = settings.redis_url or ""
        self.loops: list[LoopProcess] = []
        self._lock = threading.Lock()
        self._stopping = False

    @property
    def base_url(self) -> str:
        """HTTP base URL of the serving loop."""
        host = "127.0.0.1" if self.settings.host in ("0.0.0.0", "::") else self.settings.host
        return f"http://{host}:{self.settings.port}"

    def metrics_port(self, loop: str) -> int:
        """Port of a loop's /metrics: the server's own port, then +2, +3, +4."""
        return self.settings.port + (0 if loop == "serve" else 1 + LOOPS.index(loop))

    def metrics_url(self, loop: str) -> str | None:
        """URL of a supervised loop's /metrics, or None if that loop is not run here."""
        if loop not in self.loop_names:
            return None
        return self.base_url.rsplit(":", 1)[0] + f":{self.metrics_port(loop)}/metrics"

    def _argv(self, loop: str) -> list[str]:
        s = self.settings
        argv = [sys.executable, "-m", "liveloop.cli", loop, "--model", s.model]
        argv += ["--data-dir", str(s.data_dir), "--redis-url", self.redis_url]
        argv += ["--host", s.host, "--port", str(s.port), "--log-level", s.log_level]
        argv += ["--db-url", s.effective_db_url]
        for path in self.config_files:
            argv += ["--config", str(path)]
        if loop != "serve":
            argv += ["--metrics-port", str(self.metrics_port(loop))]
        return argv

    def start(self) -> None:
        """Start Valkey (if embedded), open the registry once (migrations), start every loop."""
        if not self.redis_url:
            self.valkey = EmbeddedValkey(self.settings.data_dir).start()
            self.redis_url = self.valkey.url
        from liveloop.registry import Registry

        Registry.open(self.settings.effective_db_url).close()
        env = dict(os.environ, **self.extra_env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        # The loops share the machine's cores: idle OpenMP workers sleep instead of spinning
        # (a spinning trainer beside the decoding engine slows both down several-fold).
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        for name in self.loop_names:
            proc = LoopProcess(
                name, self._argv(name), env, self.settings.data_dir / "logs" / f"{name}.log"
            )
            proc.start()
            self.loops.append(proc)
            log.info("started %s (pid %s)", name, proc.process.pid if proc.process else "?")

    def check(self) -> list[str]:
        """Restart crashed loops with backoff; returns one line per event, for the live view."""
        events: list[str] = []
        now = time.monotonic()
        with self._lock:
            if self._stopping:
                return events
            for loop in self.loops:
                if loop.alive:
                    if now - loop.started_at > 60:
                        loop.restarts = 0  # healthy for a while: reset the backoff
                    continue
                if loop.process is not None:
                    loop.last_exit = loop.process.returncode
                    loop.process = None
                    delay = min(MAX_BACKOFF_S, 2.0**loop.restarts)
                    loop.next_start = now + delay
                    loop.restarts += 1
                    why = exit_reason(loop.last_exit, loop.log_path)
                    msg = f"{loop.name} exited with {loop.last_exit}{f' ({why})' if why else ''}"
                    msg += f"; restarting in {delay:.0f}s"
                    loop.history.append(msg)
                    events.append(msg)
                    log.warning(msg)
                elif now >= loop.next_start:
                    loop.start()
                    events.append(f"{loop.name} restarted")
        return events

    def stop_loops(self, names: tuple[str, ...] = LOOPS, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the named loops, wait for them, SIGKILL stragglers; they stay stopped."""
        with self._lock:
            stopping = [loop for loop in self.loops if loop.name in names]
            self.loops = [loop for loop in self.loops if loop.name not in names]
            for loop in stopping:
                if loop.alive and loop.process is not None:
                    loop.process.terminate()
            deadline = time.monotonic() + grace_s
            for loop in stopping:
                if loop.process is None:
                    continue
                try:
                    loop.process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    loop.process.kill()
                    loop.process.wait()

    def stop(self) -> None:
        """Stop every loop, then Valkey."""
        self._stopping = True
        self.stop_loops()
        if self.valkey is not None:
            self.valkey.stop()
