"""The loop folders install only as subpackages of the `liveloop` namespace."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from liveloop.trainer.safeguards.sources import SHIPPED


@pytest.mark.parametrize("name", ["server", "prm", "collector", "trainer"])
def test_no_top_level_loop_module(name: str, tmp_path) -> None:
    """From a neutral directory, `import server` (etc.) fails while `liveloop.server` works."""
    code = (
        "import importlib, importlib.util, sys\n"
        f"assert importlib.util.find_spec({name!r}) is None, 'top-level {name} is importable'\n"
        f"mod = importlib.import_module('liveloop.{name}')\n"
        "print(mod.__name__)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"liveloop.{name}"


def test_builtin_judges_are_registered_under_the_namespace() -> None:
    """The `liveloop.judges` entry points name modules inside `liveloop.prm`."""
    found = {ep.name: ep.value for ep in entry_points(group="liveloop.judges")}
    for name in ("rules", "llm", "feedback"):
        assert found[name].startswith("liveloop.prm.judges."), found


def test_shipped_probe_sources_are_the_declared_entry_points() -> None:
    """The trainer knows LiveLoop's own probe sources without an installed distribution; the
    names and targets it knows are the ones the package declares."""
    found = {ep.name: ep.value for ep in entry_points(group="liveloop.probe_sources")}
    assert {name: found.get(name) for name in SHIPPED} == SHIPPED
