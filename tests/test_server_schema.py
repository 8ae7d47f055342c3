"""Schemathesis over the server's own OpenAPI schema: generated requests never get a 5xx.

Every operation gets a bounded number of generated cases, valid (positive) and invalid
(negative) ones, sent to the real server subprocess. (schemathesis' pytest integration,
`from_fixture`, does not run on this pytest, so the cases are drawn with hypothesis here.)
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.server_proc import ADMIN_KEY, API_KEYS

pytest_plugins = ["tests.server_fixtures"]

MAX_EXAMPLES = 25


def _bound(case: Any) -> None:
    """Keep generation cheap (at most 4 tokens, 2 samples) and name the served model.

    Unknown model names are tested elsewhere; here the fuzzer should reach generation.
    """
    if not isinstance(case.body, dict):
        return
    for key, cap in (("max_tokens", 4), ("max_completion_tokens", 4), ("n", 2)):
        value = case.body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            case.body[key] = cap
    if "messages" in case.body:
        case.body["model"] = "tiny-random"
    if "messages" in case.body and "max_tokens" not in case.body:
        case.body["max_tokens"] = 4


def _fuzz(operation: Any, mode: GenerationMode, server_url: str, statuses: dict[int, int]) -> None:
    key = ADMIN_KEY if operation.path.startswith("/admin") else API_KEYS[0]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    def run(case: Any) -> None:
        _bound(case)
        response = case.call_and_validate(
            base_url=server_url,
            headers={"Authorization": f"Bearer {key}"},
            checks=[not_a_server_error],
            timeout=60,
        )
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

    try:
        run()
    except Unsatisfiable:  # no invalid variant exists (e.g. GET /healthz takes no input)
        if mode is not GenerationMode.NEGATIVE:
            raise


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
