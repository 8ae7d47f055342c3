"""Schemathesis over the server's own OpenAPI schema: generated requests never get a 5xx.

Every operation gets a bounded number of generated cases, valid (positive) and invalid
(negative) ones, sent to the real server subprocess. (schemathesis' pytest integration,
`from_fixture`, does not run on this pytest, so the cases are drawn with hypothesis, by
`bench/fuzz.py`, which runs the same with a larger budget.)
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis
from schemathesis import GenerationMode

from bench.fuzz import fuzz_operation
from tests.server_proc import ADMIN_KEY, API_KEYS

pytest_plugins = ["tests.server_fixtures"]

MAX_EXAMPLES = 25  # bench/fuzz.py runs the same with a larger budget


def _fuzz(operation: Any, mode: GenerationMode, server_url: str, statuses: dict[int, int]) -> None:
    key = ADMIN_KEY if operation.path.startswith("/admin") else API_KEYS[0]
    fuzz_operation(operation, mode, server_url, statuses, key=key, max_examples=MAX_EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_no_server_errors(server_url: str, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(server_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
    assert any(op.path == "/v1/chat/completions" for op in operations)
    chat_statuses: dict[int, int] = {}
    try:
        for operation in operations:
            statuses = chat_statuses if operation.path == "/v1/chat/completions" else {}
            _fuzz(operation, mode, server_url, statuses)
    finally:  # the fuzzer may have paused trace capture
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        httpx.post(server_url + "/admin/capture/resume", headers=headers)
    if mode is GenerationMode.POSITIVE:  # the fuzzer must reach generation, not only 4xx
        assert chat_statuses.get(200, 0) > 0, chat_statuses
    print(f"chat completions statuses ({mode}): {chat_statuses}")
