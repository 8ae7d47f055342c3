"""The package's shape: no import cycles, and every Redis key named in one module.

Both are read from the source (no import needed), so a new module that breaks either rule
fails here with its name.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "liveloop"
KEYS_MODULE = PACKAGE / "bus" / "keys.py"


def modules() -> dict[str, Path]:
    """Every module of the package (the loop folders through their symlinks), by name."""
    found: dict[str, Path] = {}
    paths = [Path(d) / f for d, _s, files in os.walk(PACKAGE, followlinks=True) for f in files]
    for path in (p for p in paths if p.suffix == ".py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """The package modules a module imports, at any level (TYPE_CHECKING and lazy too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found |= {n for n in names if n in known}
    return found


def test_no_import_cycles() -> None:
    mods = modules()
    graph = {name: imports(path, set(mods)) - {name} for name, path in mods.items()}
    cycles: list[list[str]] = []

    def visit(node: str, trail: list[str], done: set[str]) -> None:
        if node in trail:
            cycles.append([*trail[trail.index(node) :], node])
            return
        if node in done:
            return
        for nxt in sorted(graph[node]):
            visit(nxt, [*trail, node], done)
        done.add(node)

    done: set[str] = set()
    for name in sorted(graph):
        visit(name, [], done)
    assert cycles == [], " ; ".join(" -> ".join(c) for c in cycles)


def _strings(tree: ast.AST) -> list[ast.Constant]:
    """String constants that are not docstrings."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        if id(node) not in docstrings
    ]


def test_redis_keys_are_named_in_one_module() -> None:
    spelled = []
    for name, path in modules().items():
        if path == KEYS_MODULE:
            continue
        for node in _strings(ast.parse(path.read_text())):
            text = node.value
            key_like = "liveloop:" in text and not any(c.isspace() for c in text)
            if key_like or "'liveloop:" in text:  # a key, or a key spelled inside Lua
                spelled.append(f"{name}:{node.lineno}")
    assert spelled == [], f"Redis key names outside liveloop.bus.keys: {spelled}"


LOOPS = ("liveloop.server", "liveloop.prm", "liveloop.collector", "liveloop.trainer")


def _inside(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_no_runtime_module_imports_the_demo() -> None:
    """The loops and the shared package never reach for the demo's simulated users: a
    deployment's gate probes its own traffic. Only the CLI, which starts the demo, may."""
    mods = modules()
    offenders = {
        name: sorted(i for i in imports(path, set(mods)) if _inside(i, ("liveloop.demo",)))
        for name, path in mods.items()
        if not _inside(name, ("liveloop.demo", "liveloop.cli"))
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_shared_modules_import_no_loop() -> None:
    """What the loops share (liveloop/ outside the loop folders), the demo included, imports
    no loop package; only the CLI composes them."""
    mods = modules()
    offenders = {
        name: sorted(i for i in imports(path, set(mods)) if _inside(i, LOOPS))
        for name, path in mods.items()
        if not _inside(name, (*LOOPS, "liveloop.cli"))
    }
    assert {k: v for k, v in offenders.items() if v} == {}
