"""Simulated users driven against the loops: populations side by side, paced by the trainer.

Both demos run users this way (`liveloop.demo.run` one population, `liveloop.demo.tenants`
one per tenant, each with its own API key), while the supervisor's events and the live view
stay fresh and the loops are kept up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from liveloop import bus
from liveloop.demo.pacing import Pacer
from liveloop.demo.users import UserRun, UserStats, run_population
from liveloop.supervisor import Supervisor


def drive(
    groups: list[tuple[UserRun, list[Any]]],
    seconds: float,
    seed: int,
    supervisor: Supervisor,
    view: Any,
    max_judged_turns: int | None = None,
    turns_per_update: int | None = None,
) -> list[UserStats]:
    """Run populations side by side (one per group: how it talks to the server, its users)
    while keeping the loops up and the live view fresh; what each group saw, in order."""
    counter = bus.redis_client_sync(supervisor.redis_url)
    scored = bus.stream_key(bus.SCORED)
    pacer = Pacer(counter, turns_per_update) if turns_per_update else None
    if pacer is not None:
        groups = [(dataclasses.replace(run, pace=pacer.wait), people) for run, people in groups]
    users = sum(len(people) for _run, people in groups)

    async def main() -> list[UserStats]:
        stats = [UserStats() for _ in groups]
        tasks = [
            asyncio.create_task(
                run_population(run, people, seconds=seconds, seed=seed + 101 * i, stats=stats[i])
            )
            for i, (run, people) in enumerate(groups)
        ]
        t0 = time.monotonic()
        while not all(task.done() for task in tasks):
            for event in supervisor.check():
                view.event(event)
            view.extra["demo"] = f"{time.monotonic() - t0:.0f}s of {seconds:.0f}s, {users} users"
            view.refresh()
            if max_judged_turns is not None and int(counter.xlen(scored)) >= max_judged_turns:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                return stats
            await asyncio.sleep(1.0)
        for task in tasks:
            task.result()
        return stats

    try:
        return asyncio.run(main())
    finally:
        counter.close()
