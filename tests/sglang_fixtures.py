"""Pytest plugin of the SGLang tests: two real SGLang servers on CPU for the whole session.

Loaded with `pytest_plugins = ["tests.sglang_fixtures"]`; its fixtures are only set up by
tests marked `sglang`, which `make test-sglang` runs (see tests/support/sglang.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.sglang import SGLangServers


@pytest.fixture(scope="session")
def sglang_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServers]:
    """Two SGLang servers on smollm2-135m (at most two run at a time on this machine)."""
    servers = SGLangServers(2, tmp_path_factory.mktemp("sglang-logs"))
    if servers.external:  # already running (developing): neither started nor stopped here
        yield servers
        return
    try:
        servers.start()
        yield servers
    finally:
        servers.stop()


@pytest.fixture
def sglang_urls(sglang_servers: SGLangServers) -> list[str]:
    """The servers' URLs, after restarting any that an earlier test killed."""
    sglang_servers.ensure_running()
    return sglang_servers.urls
