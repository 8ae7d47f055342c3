"""Schemathesis over the server's OpenAPI schema with a large example budget.

Why: `make test` fuzzes every operation with a small budget; a bigger one finds rarer
inputs. Each operation gets `max_examples` generated requests in positive (valid) and
negative (invalid) mode against a real server; any 5xx is a bug. Prints per mode the
requests sent, the statuses seen and the operations that produced a server error.
The test suite uses `bound_case` and `fuzz_operation` from here with a small budget.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from bench.fleet import Fleet

API_KEY = "sk-fuzz-alpha"
ADMIN_KEY = "sk-fuzz-admin"


def bound_case(case: Any) -> None:
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


def fuzz_operation(
    operation: Any,
    mode: GenerationMode,
    server_url: str,
    statuses: dict[int, int],
    *,
    key: str,
    max_examples: int,
) -> None:
    """Send `max_examples` generated cases; raises (shrunk) on a 5xx."""

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    def run(case: Any) -> None:
        bound_case(case)
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


def run_fuzz(root: Path, *, max_examples: int = 200) -> dict[str, Any]:
    """Every operation, both modes, `max_examples` cases each; statuses and 5xx found."""
    env = {"LIVELOOP_API_KEYS": API_KEY, "LIVELOOP_ADMIN_KEY": ADMIN_KEY}
    fleet = Fleet(root, env=env, loops=("serve",))
    fleet.start()
    result: dict[str, Any] = {"scenario": "fuzz", "max_examples_per_operation": max_examples}
    try:
        schema = schemathesis.openapi.from_url(fleet.base_url + "/openapi.json")
        operations = [r.ok() for r in schema.get_all_operations()]  # type: ignore[union-attr]
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            statuses: dict[int, int] = {}
            errors: list[str] = []
            for op in operations:
                key = ADMIN_KEY if op.path.startswith("/admin") else API_KEY
                try:
                    fuzz_operation(
                        op, mode, fleet.base_url, statuses, key=key, max_examples=max_examples
                    )
                except Exception as exc:  # a 5xx (or a crash): keep going, report it
                    errors.append(f"{op.method.upper()} {op.path}: {str(exc)[:300]}")
            httpx.post(
                fleet.base_url + "/admin/capture/resume",
                headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            )
            result[str(mode)] = {
                "requests": sum(statuses.values()),
                "statuses": dict(sorted(statuses.items())),
                "server_errors": errors,
            }
        result["server_alive"] = fleet.loops["serve"].alive
    finally:
        fleet.stop()
    return result
