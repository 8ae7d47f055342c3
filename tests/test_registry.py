"""Tests of the registry against SQLite and, when its binaries are present, PostgreSQL.

The PostgreSQL server is a throwaway cluster in a temporary directory, listening only on
a Unix socket there; as root it runs as `nobody`, since `initdb` refuses root.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from glob import glob
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text
from sqlalchemy.engine import make_url

from liveloop.registry import Registry, RegistryError, SessionOwnershipError
from liveloop.registry.migrate import (
    VERSION_TABLE,
    alembic_config,
    current_revision,
    head_revision,
    make_engine,
    sqlite_file,
)
from liveloop.registry.models import Base

PG_USER = "liveloop"


def _major_version(initdb: str) -> tuple[int, ...]:
    """Sort key of /usr/lib/postgresql/<version>/bin/initdb by numeric version."""
    return tuple(int(part) for part in re.findall(r"\d+", Path(initdb).parents[1].name))


def _pg_bindir() -> Path | None:
    """Directory holding initdb and pg_ctl, from PATH or /usr/lib/postgresql/*/bin."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(os.path.realpath(found)).parent
    candidates = sorted(glob("/usr/lib/postgresql/*/bin/initdb"), key=_major_version)
    for initdb in reversed(candidates):
        if Path(initdb).with_name("pg_ctl").exists():
            return Path(initdb).parent
    return None


def _unprivileged_prefix() -> list[str] | None:
    """Command prefix that drops root to `nobody`; [] when not root; None if impossible."""
    if os.geteuid() != 0:
        return []
    if shutil.which("runuser"):
        return ["runuser", "-u", "nobody", "--"]
    if shutil.which("setpriv"):
        return ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--"]
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run(prefix: list[str], *args: str) -> None:
    result = subprocess.run([*prefix, *args], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"{args[0]} failed: {result.stderr.strip() or result.stdout.strip()}")


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[tuple[str, int]]:
    """A throwaway PostgreSQL cluster; yields (socket dir, port)."""
    pytest.importorskip("psycopg", reason="psycopg is not installed")
    bindir = _pg_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) not found")
    prefix = _unprivileged_prefix()
    if prefix is None:
        pytest.skip("running as root without runuser/setpriv: initdb refuses root")
    root = Path(tempfile.mkdtemp(prefix="liveloop-pg-"))
    data, sockets, port = root / "data", root / "sock", _free_port()
    sockets.mkdir()
    if prefix:
        for path in (root, sockets):
            shutil.chown(path, "nobody")
    try:
        initdb = [str(bindir / "initdb"), "-D", str(data), "-U", PG_USER, "-A", "trust"]
        _run(prefix, *initdb, "-E", "UTF8", "--no-sync")
        options = f"-p {port} -k {sockets} -c listen_addresses='' -c fsync=off"
        pg_ctl = str(bindir / "pg_ctl")
        _run(prefix, pg_ctl, "-D", str(data), "-l", str(root / "log"), "-o", options, "-w", "start")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"cannot start a throwaway PostgreSQL: {exc}")
    try:
        yield str(sockets), port
    finally:
        subprocess.run(
            [*prefix, pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"],
            check=False,
            capture_output=True,
        )
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def postgres_url(postgres_server: tuple[str, int]) -> str:
    """URL of a fresh, empty database in the throwaway cluster."""
    import psycopg

    sockets, port = postgres_server
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(
        host=sockets, port=port, user=PG_USER, dbname="postgres", autocommit=True
    ) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"postgresql+psycopg://{PG_USER}@/{name}?host={sockets}&port={port}"


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of an empty registry database of each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'nested' / 'registry.sqlite'}"
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture
def registry(db_url: str) -> Iterator[Registry]:
    """An open registry on a fresh database."""
    reg = Registry.open(db_url)
    yield reg
    reg.close()


# -- migrations -------------------------------------------------------------------------


def test_migrations_apply_on_fresh_db_and_reapply_is_noop(db_url: str) -> None:
    reg = Registry.open(db_url)
    try:
        assert current_revision(reg.engine) == head_revision() is not None
        tables = set(inspect(reg.engine).get_table_names())
        assert {"runs", "model_versions", "sessions", VERSION_TABLE} <= tables
        reg.add_model_version(1, "/ckpt/1", None)
    finally:
        reg.close()
    again = Registry.open(db_url)
    try:
        assert current_revision(again.engine) == head_revision()
        assert [v.version for v in again.list_model_versions()] == [1]
    finally:
        again.close()


def test_an_upgrade_names_the_tenant_of_every_recorded_versions_measures(db_url: str) -> None:
    """Migration 0005 fills in version_quality.tenant from the versions still recorded."""
    url = make_url(db_url)
    if (path := sqlite_file(url)) is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    engine = make_engine(url)
    config = alembic_config()
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.upgrade(config, "0004")
        now = {"t": datetime.now(UTC)}
        conn.execute(
            text(
                "INSERT INTO model_versions (version, path, created_at, metrics, status, tenant) "
                "VALUES (2, '/ckpt/2', :t, '{}', 'accepted', 'tenant-a')"
            ),
            now,
        )
        for version in (2, 3):  # v3's own row is gone (pruned): its tenant is unknown
            conn.execute(
                text("INSERT INTO version_quality (version, updated_at) VALUES (:v, :t)"),
                {"v": version, **now},
            )
    engine.dispose()
    with Registry.open(db_url) as reg:
        assert current_revision(reg.engine) == head_revision()
        assert [q.version for q in reg.version_quality("tenant-a")] == [2]
        assert [q.version for q in reg.version_quality()] == [2, 3]


def test_models_match_migrations(registry: Registry) -> None:
    with registry.engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        assert compare_metadata(context, Base.metadata) == []


# -- runs -------------------------------------------------------------------------------


def test_runs_start_and_finish(registry: Registry) -> None:
    run_id = registry.start_run("train", {"lr": 1e-5, "dir": Path("/x")})
    run = registry.get_run(run_id)
    assert run is not None
    assert (run.kind, run.status, run.finished_at) == ("train", "running", None)
    assert run.config == {"lr": 1e-5, "dir": "/x"}
    registry.finish_run(run_id, status="failed")
    done = registry.get_run(run_id)
    assert done is not None and done.status == "failed"
    assert done.finished_at is not None and done.finished_at >= done.started_at
    assert registry.start_run("serve", {}) != run_id
    with pytest.raises(RegistryError, match="no run"):
        registry.finish_run(999_999)


# -- model versions ---------------------------------------------------------------------


def test_model_versions_roundtrip(registry: Registry) -> None:
    run_id = registry.start_run("train", {})
    registry.add_model_version(0, "/ckpt/v0", None)
    registry.add_model_version(1, "/ckpt/v1", 0, {"loss": 0.5, "reward": -0.25}, run_id)
    v0, v1 = registry.get_model_version(0), registry.get_model_version(1)
    assert v0 is not None and v1 is not None
    assert (v0.path, v0.parent, v0.metrics, v0.run_id) == ("/ckpt/v0", None, {}, None)
    assert (v1.path, v1.parent, v1.run_id) == ("/ckpt/v1", 0, run_id)
    assert v1.metrics == {"loss": 0.5, "reward": -0.25}
    assert v1.created_at.tzinfo is not None
    assert registry.get_model_version(7) is None


def test_latest_and_list_ordering(registry: Registry) -> None:
    assert registry.latest_model_version() is None
    assert registry.list_model_versions() == []
    for version in (3, 1, 10, 2):
        registry.add_model_version(version, f"/ckpt/{version}", version - 1 or None)
    latest = registry.latest_model_version()
    assert latest is not None and latest.version == 10
    assert [v.version for v in registry.list_model_versions()] == [10, 3, 2, 1]
    assert [v.version for v in registry.list_model_versions(limit=2)] == [10, 3]


def test_add_model_version_is_idempotent(registry: Registry) -> None:
    registry.add_model_version(5, "/ckpt/5", 4, {"loss": 1.0})
    registry.add_model_version(5, "/ckpt/5", 4, {"loss": 1.0})
    registry.add_model_version(5, "/elsewhere", None, {"loss": 2.0})  # first write wins
    versions = registry.list_model_versions()
    assert len(versions) == 1
    assert (versions[0].path, versions[0].parent, versions[0].metrics) == (
        "/ckpt/5",
        4,
        {"loss": 1.0},
    )


def test_delete_model_version_keeps_lineage(registry: Registry) -> None:
    registry.add_model_version(1, "/ckpt/1", None)
    registry.add_model_version(2, "/ckpt/2", 1)
    registry.delete_model_version(1)
    registry.delete_model_version(42)  # unknown: no-op
    assert registry.get_model_version(1) is None
    child = registry.get_model_version(2)
    assert child is not None and child.parent == 1


def test_adapter_versions_by_tenant_and_forgetting_a_tenant(registry: Registry) -> None:
    registry.add_model_version(1, "/ckpt/1", None)
    registry.add_model_version(2, "/ckpt/2", 1, adapter="tenant-a", tenant="tenant-a")
    registry.add_model_version(3, "/ckpt/3", 1, adapter="tenant-b", tenant="tenant-b")
    registry.upsert_session("s-a", "tenant-a")
    registry.upsert_session("s-b", "tenant-b")
    (mine,) = registry.list_model_versions(tenant="tenant-a")
    assert (mine.version, mine.adapter, mine.tenant) == (2, "tenant-a", "tenant-a")
    assert registry.delete_tenant("tenant-a") == {"versions": 1, "sessions": 1}
    assert registry.get_model_version(2) is None and registry.get_session("s-a") is None
    assert [v.version for v in registry.list_model_versions()] == [3, 1]
    assert registry.get_session("s-b") is not None
    assert registry.delete_tenant("never-seen") == {"versions": 0, "sessions": 0}


def test_a_tenants_pruned_versions_keep_their_measures_until_the_tenant_leaves(
    registry: Registry,
) -> None:
    """A version's measures outlive its pruned row, and its probe examples are its tenant's
    prompts: they name the tenant, show in its versions and go with its deletion."""
    example = {"examples": [{"question": "A's customer asks about invoices", "reply": "..."}]}
    for version, tenant in ((2, "tenant-a"), (3, "tenant-b"), (4, "tenant-a")):
        registry.add_model_version(version, f"/ckpt/{version}", 1, adapter=tenant, tenant=tenant)
        registry.record_version_quality(version, probe=example)
    registry.record_version_quality(4, served={"judged": 20})  # its row already names A
    registry.delete_model_version(2)  # checkpoint pruned
    registry.delete_model_version(4)
    assert [q.version for q in registry.version_quality("tenant-a")] == [2, 4]
    assert [q.version for q in registry.version_quality()] == [2, 3, 4]
    assert registry.delete_tenant("tenant-a") == {"versions": 0, "sessions": 0}
    assert [q.version for q in registry.version_quality()] == [3]
    assert registry.version_quality("tenant-a") == []


def test_non_finite_metrics_are_dropped_and_unknown_run_rejected(registry: Registry) -> None:
    registry.add_model_version(1, "/ckpt/1", None, {"loss": float("nan"), "kl": 0.1})
    version = registry.get_model_version(1)
    assert version is not None and version.metrics == {"kl": 0.1}
    with pytest.raises(RegistryError):
        registry.add_model_version(2, "/ckpt/2", 1, run_id=424242)


# -- sessions ---------------------------------------------------------------------------


def test_sessions_count_turns_and_scores(registry: Registry) -> None:
    assert registry.get_session("s1") is None
    registry.upsert_session("s1", "tenant-a")
    registry.upsert_session("s1", "tenant-a", turn_type="side")
    registry.upsert_session("s1", "tenant-a", score=0.5)
    registry.upsert_session("s1", "tenant-a", score=-1.0, count_turn=False, summary={"k": 1})
    info = registry.get_session("s1")
    assert info is not None
    assert (info.tenant, info.turns, info.main_turns, info.side_turns) == ("tenant-a", 3, 2, 1)
    assert (info.scored_turns, info.last_score, info.summary) == (2, -1.0, {"k": 1})
    assert info.mean_score == pytest.approx(-0.25)
    assert info.last_seen_at >= info.created_at


def test_session_owned_by_one_tenant(registry: Registry) -> None:
    registry.upsert_session("s1", "tenant-a")
    with pytest.raises(SessionOwnershipError):
        registry.upsert_session("s1", "tenant-b")
    info = registry.get_session("s1")
    assert info is not None and (info.tenant, info.turns) == ("tenant-a", 1)
    with pytest.raises(ValueError):
        registry.upsert_session("s1", "tenant-a", turn_type="tool")


def test_concurrent_session_upserts_lose_no_turn(registry: Registry) -> None:
    def work(index: int) -> None:
        for _ in range(5):
            registry.upsert_session("shared", "t", turn_type="main" if index % 2 else "side")

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(work, range(4)))
    info = registry.get_session("shared")
    assert info is not None and (info.turns, info.main_turns, info.side_turns) == (20, 10, 10)


# -- opening ----------------------------------------------------------------------------


def test_concurrent_open_threads(db_url: str) -> None:
    with ThreadPoolExecutor(max_workers=4) as pool:
        registries = list(pool.map(lambda _: Registry.open(db_url), range(4)))
    try:
        for index, reg in enumerate(registries):
            reg.add_model_version(index, f"/ckpt/{index}", None)
        assert len(registries[0].list_model_versions()) == 4
    finally:
        for reg in registries:
            reg.close()


_CHILD = """
import sys
from liveloop.registry import Registry
reg = Registry.open(sys.argv[1])
for _ in range(5):
    reg.upsert_session("shared", "t")
reg.close()
"""


def test_concurrent_open_processes_on_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'deep' / 'dir' / 'registry.sqlite'}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
        ),
    }
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, url], env=env, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    errors = [child.communicate(timeout=120)[1] for child in children]
    assert [child.returncode for child in children] == [0, 0, 0], errors
    with Registry.open(url) as reg:
        info = reg.get_session("shared")
        assert info is not None and info.turns == 15
        assert current_revision(reg.engine) == head_revision()


@pytest.mark.parametrize(
    "make_url",
    [
        lambda tmp: "nosuchdialect://user:hunter2@host/db",
        lambda tmp: "not a url at all",
        lambda tmp: f"postgresql+psycopg://user:hunter2@127.0.0.1:{_free_port()}/db",
        lambda tmp: f"sqlite:///{tmp / 'file'}/registry.sqlite",
    ],
    ids=["unknown-dialect", "garbage", "refused", "parent-is-a-file"],
)
def test_bad_url_raises_one_line_error(make_url: Callable[[Path], str], tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    url = make_url(tmp_path)
    if "psycopg" in url:
        pytest.importorskip("psycopg")
    with pytest.raises(RegistryError) as caught:
        Registry.open(url)
    message = str(caught.value)
    assert message.startswith("cannot open registry at ")
    assert "\n" not in message and "hunter2" not in message
