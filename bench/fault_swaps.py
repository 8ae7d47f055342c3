"""Weight swaps under load: many concurrent streams across a series of hot-swaps and refusals.

Why: agents must never see an error or a token from an older policy after a newer one
because the trainer published weights, and a bad checkpoint must never reach the engine.
`run_swaps_under_load` starts the server, keeps `streams` streaming requests open at once
(each client starts its next stream when one ends) and, meanwhile, announces `swaps`
perturbed checkpoints on `liveloop:weights` with corrupt ones in between (truncated file,
wrong shapes, NaNs, missing file), each once the server dealt with the one before. It counts failed
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
from liveloop.server.http_guard import REASONS

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
    lines: list[str] = []
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                lines.append(line)
    except httpx.HTTPError as exc:  # how far it got tells a reset request from a cut stream
        return {"ok": False, "status": 0, "error": f"{exc!r} after {len(lines)} lines"}
    errors = [e for e in (_event(line) for line in lines) if isinstance(e, dict) and "error" in e]
    done = "data: [DONE]" in lines
    return {
        "ok": response.status_code == 200 and done and not errors,
        "status": response.status_code,
        "error": (errors[0]["error"] if errors else None) or (None if done else "no [DONE]"),
        "seconds": time.perf_counter() - started,
    }


def _event(line: str) -> Any:
    """The JSON of an SSE data line (None for other lines and [DONE])."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    return json.loads(line[len("data: ") :])


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
) -> tuple[list[dict[str, Any]], int]:
    """`streams` clients each streaming one request after another until every announcement
    has been dealt with: every outcome, and how many streams were open at that moment."""
    limits = httpx.Limits(max_connections=streams + 8)
    done = asyncio.Event()
    results: list[dict[str, Any]] = []
    open_streams = [0]

    async def client_loop(http: httpx.AsyncClient, i: int) -> None:
        n = 0
        while not done.is_set():
            open_streams[0] += 1
            try:
                results.append(await _stream(http, i * 1000 + n, max_tokens))
            finally:
                open_streams[0] -= 1
            n += 1

    async with httpx.AsyncClient(base_url=fleet.base_url, timeout=300, limits=limits) as http:
        tasks = [asyncio.create_task(client_loop(http, i)) for i in range(streams)]
        await _announce(fleet.redis_url, http, plan, paths, gap_s)
        open_at_last_swap = open_streams[0]
        done.set()
        await asyncio.gather(*tasks)
    return results, open_at_last_swap


def run_swaps_under_load(
    root: Path, *, streams: int = 200, swaps: int = 10, max_tokens: int = 96, gap_s: float = 0.1
) -> dict[str, Any]:
    """`streams` concurrent streams across `swaps` hot-swaps and 4 corrupt checkpoints."""
    paths = make_checkpoints(root / "checkpoints", swaps)
    plan = announcement_plan(swaps)
    fleet = Fleet(root, env={"LIVELOOP_ADMIN_KEY": ADMIN_KEY}, loops=("serve",))
    fleet.start()
    try:
        results, open_at_last = asyncio.run(_drive(fleet, streams, max_tokens, plan, paths, gap_s))
        served_version = _wait_version(fleet, len(plan), 30.0)
        admin = httpx.get(
            fleet.base_url + "/admin/weights",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=10,
        ).json()
        text = httpx.get(fleet.base_url + "/metrics", timeout=10).text
        client = redis.Redis.from_url(fleet.redis_url, decode_responses=True)
        try:
            _wait_records(client, len(results), 30.0)
            records = [json.loads(f["data"]) for f in entries(client, "turns")]
        finally:
            client.close()
    finally:
        fleet.stop()
    versions = [r["versions"] for r in records]
    refused_names = [Path(r["path"]).name for r in admin.get("refused", [])]
    return {
        "scenario": "swaps_under_load",
        "concurrent_streams": streams,
        "requests": len(results),
        "failed": sum(1 for r in results if not r["ok"]),
        "failures": [(r["status"], r["error"]) for r in results if not r["ok"]][:5],
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
        "streams_open_at_last_swap": open_at_last,
        "distinct_versions_served": len({x for v in versions for x in v}),
        "connections_closed_by_limits": {
            reason: metric(text, f'liveloop_http_connections_closed_total{{reason="{reason}"}}')
            for reason in REASONS
        },
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
