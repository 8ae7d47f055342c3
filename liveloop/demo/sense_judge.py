"""The demo's sense judge: a second model, served in a process of its own, that reads each
held-out reply with its question and says whether it is a sensible answer.

Word-level measures (topic rate, non-answers) miss fluent nonsense; a judge model that
reads the pair does not. With `demo.sense_model` set, the demo serves that model on a port
and Valkey of its own (nothing it answers is ever a training turn) for the whole run, rates
the held-out replies of version 0 and of the final version with it, and, with
`demo.sense_gate`, hands it to the promotion gate for its probes. The check itself comes
from the CLI (`liveloop.sense.SenseCheckFactory`): the demo imports no loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from liveloop.config import LiveLoopSettings
from liveloop.sense import SenseCheckFactory
from liveloop.supervisor import Supervisor
from liveloop.valkey import free_port


@contextlib.contextmanager
def sense_judge_server(settings: LiveLoopSettings, run_dir: Path) -> Iterator[str | None]:
    """The judge model's OpenAI base URL while it is served (None without a sense model)."""
    model = settings.demo.sense_model
    if not model:
        yield None
        return
    from liveloop.demo.heldout import wait_ready
    from liveloop.models import resolve_model_dir

    resolve_model_dir(model)  # fetch and convert once, before the clock starts
    child = settings.model_copy(
        update={
            "model": model,
            "data_dir": run_dir / "sense-judge",
            "port": free_port(),
            "redis_url": None,
            "db_url": None,
        }
    )
    supervisor = Supervisor(child, loops=("serve",))
    supervisor.start()
    try:
        wait_ready(supervisor.base_url, supervisor, timeout_s=900)
        yield supervisor.base_url + "/v1"
    finally:
        supervisor.stop()


def gate_env(settings: LiveLoopSettings, base_url: str | None) -> dict[str, str]:
    """The trainer's settings that point its promotion gate at the judge (`demo.sense_gate`)."""
    if base_url is None or not settings.demo.sense_gate:
        return {}
    return {
        "LIVELOOP_TRAINER__GATE__SENSE__BASE_URL": base_url,
        "LIVELOOP_TRAINER__GATE__SENSE__MODEL": str(settings.demo.sense_model),
    }


def rate_held_out(
    evals: dict[str, Any], base_url: str, model: str | None, factory: SenseCheckFactory
) -> None:
    """Add each evaluated version's sense rate (and what it cost) to its held-out row."""

    async def rate_all() -> None:
        check = factory(base_url, model)
        try:
            for row in evals.values():
                pairs = [(r["question"], r["reply"]) for r in row.get("replies") or []]
                report = await check.rate(pairs)
                row.update(report.as_dict())
                for reply, verdict in zip(row.get("replies") or [], report.verdicts, strict=True):
                    reply["sensible"] = verdict
        finally:
            await check.aclose()

    asyncio.run(rate_all())
