"""`liveloop serve` start-up failures: one line on stderr and a non-zero exit, fast."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

from liveloop.valkey import EmbeddedValkey, free_port
from tests.server_proc import ServerProcess


def _run(server: ServerProcess) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        server.command(), env=server.environment(), capture_output=True, text=True, timeout=120
    )


def _one_line_error(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("liveloop serve: error:")
    for word in words:
        assert word in lines[0], lines[0]
    assert "Traceback" not in proc.stderr


def test_port_in_use(valkey_server: EmbeddedValkey, tmp_path: Path) -> None:
    server = ServerProcess(valkey_server.url, tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", server.port))
        taken.listen(1)
        _one_line_error(_run(server), "cannot listen", str(server.port))


def test_unreachable_redis(tmp_path: Path) -> None:
    server = ServerProcess(f"redis://127.0.0.1:{free_port()}/0", tmp_path)
    _one_line_error(_run(server), "cannot reach Redis")


def test_bad_model(valkey_server: EmbeddedValkey, tmp_path: Path) -> None:
    server = ServerProcess(valkey_server.url, tmp_path, model=str(tmp_path / "no-such-model"))
    _one_line_error(_run(server), "no-such-model")


def test_model_that_fails_to_load_in_the_engine_worker(
    valkey_server: EmbeddedValkey, tmp_path: Path
) -> None:
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # resolves as a model dir, cannot load
    server = ServerProcess(valkey_server.url, tmp_path, model=str(broken))
    _one_line_error(_run(server), "broken-model")
