"""Weight swaps under load: many concurrent streams across a series of hot-swaps and refusals.

Why: agents must never see an error or a token from an older policy after a newer one
because the trainer published weights, and a bad checkpoint must never reach the engine.
`run_swaps_under_load` starts the server, opens `streams` concurrent streaming requests and,
while they run, announces `swaps` perturbed checkpoints on `liveloop:weights` with corrupt
ones in between (truncated file, wrong shapes, NaNs, missing file). It counts failed
requests, records whose per-token versions go backwards, records that span a swap, and the
refusals as the server reports them on `/admin/weights` and `/metrics`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from pathlib import Path
from typing import Any

import httpx
import redis

from bench.audit import entries
from bench.fault_outages import metric
from bench.fleet import Fleet

ADMIN_KEY = "sk-bench-admin"
CORRUPT = ("truncated", "wrong_shapes", "nans", "missing")


def make_checkpoints(directory: Path, valid: int) -> dict[str, Path]:
    """`valid` perturbed copies of tiny-random (single safetensors files) and one of each
    kind of corrupt checkpoint; by name (`v1`.. and the CORRUPT names)."""
    import torch
    from safetensors.torch import save_file

    from liveloop.models import load_model

    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().clone() for k, v in load_model("tiny-random").model.state_dict().items()}
    state.pop("lm_head.weight", None)  # tied to the embeddings
    out: dict[str, Path] = {}
    gen = torch.Generator().manual_seed(0)
    for i in range(1, valid + 1):
        noisy = {k: v + 0.02 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
        out[f"v{i}"] = directory / f"v{i}.safetensors"
        save_file(noisy, out[f"v{i}"])
    data = out["v1"].read_bytes()
    out["truncated"] = directory / "truncated.safetensors"
    out["truncated"].write_bytes(data[: len(data) // 2])
    shapes = dict(state)
    shapes["model.norm.weight"] = torch.ones(3)
    out["wrong_shapes"] = directory / "shapes.safetensors"
    save_file(shapes, out["wrong_shapes"])
    nans = dict(state)
    nans["model.norm.weight"] = torch.full_like(state["model.norm.weight"], float("nan"))
    out["nans"] = directory / "nans.safetensors"
    save_file(nans, out["nans"])
    out["missing"] = directory / "gone" / "model.safetensors"
    return out


def announcement_plan(valid: int) -> list[str]:
    """The order of announcements: valid versions with the corrupt ones spread between."""
    plan = [f"v{i}" for i in range(1, valid + 1)]
    for j, name in enumerate(CORRUPT):
        plan.insert(min(len(plan), 2 + j * 3), name)
    return plan


async def _stream(client: httpx.AsyncClient, i: int, max_tokens: int) -> dict[str, Any]:
    body = {
        "model": "tiny-random",
        "messages": [{"role": "user", "content": f"stream {i}: tell me a story"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            text = "".join([line async for line in response.aiter_lines()])
            ok = response.status_code == 200 and "data: [DONE]" in text and '"error"' not in text
            return {
                "ok": ok,
                "status": response.status_code,
                "session": response.headers.get("x-session-id"),
                "seconds": time.perf_counter() - started,
                "ended": time.perf_counter(),
            }
    except httpx.HTTPError as exc:
        return {"ok": False, "status": 0, "error": repr(exc), "ended": time.perf_counter()}


async def _considered(http: httpx.AsyncClient) -> float:
    """Checkpoints the server has swapped in or refused so far."""
    text = (await http.get("/metrics")).text
    return sum(
        metric(text, f'liveloop_weight_swaps_total{{outcome="{o}"}}') for o in ("ok", "refused")
    )


async def _announce(
    url: str, http: httpx.AsyncClient, plan: list[str], paths: dict[str, Path], gap_s: float
) -> None:
    """Announce each checkpoint once the server has dealt with the previous one (so every
    one is tried: the server skips to the newest of several waiting announcements)."""
    from redis.asyncio import from_url

    from liveloop import bus
    from liveloop.contracts import WeightsAnnouncement

    client = from_url(url, decode_responses=True)
    try:
        for version, name in enumerate(plan, start=1):
            await asyncio.sleep(gap_s)
            payload = WeightsAnnouncement(version=version, path=str(paths[name]))
            await bus.publish(client, bus.WEIGHTS, payload)
            deadline = time.monotonic() + 60
            while await _considered(http) < version and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
    finally:
        await client.aclose()


async def _drive(
    fleet: Fleet,
    streams: int,
    max_tokens: int,
    plan: list[str],
    paths: dict[str, Path],
    gap_s: float,
) -> tuple[list[dict[str, Any]], float]:
    """Every stream's outcome, and when the last announcement had been dealt with."""
    limits = httpx.Limits(max_connections=streams + 8)
    async with httpx.AsyncClient(base_url=fleet.base_url, timeout=300, limits=limits) as client:
        tasks = [asyncio.create_task(_stream(client, i, max_tokens)) for i in range(streams)]
        await _announce(fleet.redis_url, client, plan, paths, gap_s)
        last_swap = time.perf_counter()
        return list(await asyncio.gather(*tasks)), last_swap


def run_swaps_under_load(
    root: Path, *, streams: int = 200, swaps: int = 10, max_tokens: int = 96, gap_s: float = 0.1
) -> dict[str, Any]:
    """`streams` concurrent streams across `swaps` hot-swaps and 4 corrupt checkpoints."""
    paths = make_checkpoints(root / "checkpoints", swaps)
    plan = announcement_plan(swaps)
    fleet = Fleet(root, env={"LIVELOOP_ADMIN_KEY": ADMIN_KEY}, loops=("serve",))
    fleet.start()
    try:
        results, last_swap = asyncio.run(_drive(fleet, streams, max_tokens, plan, paths, gap_s))
        served_version = _wait_version(fleet, len(plan), 30.0)
        admin = httpx.get(
            fleet.base_url + "/admin/weights",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=10,
        ).json()
        text = httpx.get(fleet.base_url + "/metrics", timeout=10).text
        client = redis.Redis.from_url(fleet.redis_url, decode_responses=True)
        try:
            _wait_records(client, streams, 30.0)
            records = [json.loads(f["data"]) for f in entries(client, "turns")]
        finally:
            client.close()
    finally:
        fleet.stop()
    versions = [r["versions"] for r in records]
    refused_names = [Path(r["path"]).name for r in admin.get("refused", [])]
    return {
        "scenario": "swaps_under_load",
        "streams": streams,
        "failed": sum(1 for r in results if not r["ok"]),
        "announced": len(plan),
        "swaps_ok": metric(text, 'liveloop_weight_swaps_total{outcome="ok"}'),
        "refused": metric(text, 'liveloop_weight_swaps_total{outcome="refused"}'),
        "refused_in_admin": len(refused_names),
        "refusals_listed": refused_names,
        "served_version_after": served_version,
        "records": len(records),
        "records_versions_backwards": sum(
            1 for v in versions if any(b < a for a, b in itertools.pairwise(v))
        ),
        "records_spanning_a_swap": sum(1 for v in versions if len(set(v)) > 1),
        "streams_open_at_last_swap": streams - sum(1 for r in results if r["ended"] < last_swap),
        "distinct_versions_served": len({x for v in versions for x in v}),
    }


def _wait_version(fleet: Fleet, version: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        served = int(
            httpx.get(fleet.base_url + "/v1/models", timeout=5).headers["x-policy-version"]
        )
        if served >= version or time.monotonic() > deadline:
            return served
        time.sleep(0.2)


def _wait_records(client: redis.Redis, count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while client.xlen("liveloop:turns") < count and time.monotonic() < deadline:
        time.sleep(0.1)
