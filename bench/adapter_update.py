"""Benchmark of publishing a new policy version to a live server: LoRA adapter vs merged weights.

Why: a new adapter version should reach traffic far sooner than merged full weights, and
loading one adapter should not stall the streams of other adapters (issue 41). This measures
both on the real path: a `liveloop serve` process (torch engine in its worker process, its own
embedded Valkey, `server.max_loaded_adapters` set), versions written with the weight transport
as the trainer writes them (`SharedDiskTransport.write` for merged weights, `write_adapter` for
a PEFT adapter with `liveloop_adapter.json`) and announced with a `WeightsAnnouncement` XADD.

1. Announce to first token: right after the announcement, one-token streamed chat requests
   go one after another (`--pollers` such loops, default 1; from the tenant whose own
   adapter is updated, or, for merged weights, a tenant served by the base) until one's
   `X-Policy-Version` (and `X-Policy-Adapter`) name the new version; its token's arrival is
   the figure (resolution: about one polling request, whose median latency is reported).
   Each prompt is its own. With several loops the engine keeps admitting one-token requests
   within one iteration (a prompt mostly in the prefix cache costs a few tokens of its
   prefill budget), and the swap waits behind them: `--pollers 3` shows that cost. Split:
   when GET /admin/weights first shows the version (polled), and the server's own
   `loaded_at` stamp in its history. The checkpoint's write time comes before the
   announcement and is reported apart. Rounds alternate the two kinds; figures are medians,
   the ratio a median of per-round ratios.
2. Other streams during an update: `--streams` streams of other tenants (own adapters, and the
   base) decode while adapter X gets a new version, or while merged weights are loaded; their
   largest inter-token gap within [announcement, loaded] is set against the same streams in
   an undisturbed window of the same length (run right after) and the median gap (one decode
   step). Streams are cut by the client after the window; any other ending is a failure.

Prints one JSON object on stdout, progress on stderr; stops the server and Valkey it starts.

    python bench/adapter_update.py --models smollm2-135m --rounds 6 --gap-rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from liveloop import bus
from liveloop.config import LiveLoopSettings
from liveloop.contracts import WeightsAnnouncement
from liveloop.demo.heldout import wait_ready
from liveloop.models import load_model
from liveloop.server.api.auth import tenant_id
from liveloop.supervisor import Supervisor
from liveloop.valkey import free_port
from liveloop.weights import SharedDiskTransport

ADMIN_KEY = "sk-bench-admin"
UPDATED = "adapter-x"  # the adapter whose new versions are measured
OTHER_ADAPTERS = ("adapter-o1", "adapter-o2", "adapter-o3")  # each its own tenant's
BASE_KEY = "sk-bench-base"  # a tenant without an adapter: served by the base weights
PROMPT = "Write a long story about a lighthouse keeper and the sea."


def key_of(adapter: str) -> str:
    """The API key of the tenant that owns `adapter`."""
    return f"sk-bench-{adapter}"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Published:
    """A version written to disk (not yet announced, until `announced_at` is set)."""

    version: int
    path: str
    adapter: str | None  # None: merged full weights
    tenant: str | None
    write_s: float
    announced_at: float = 0.0


class Publisher:
    """Writes and announces versions as the trainer does, through the weight transport."""

    def __init__(self, model: str, root: Path, redis_url: str, rank: int) -> None:
        import torch
        from peft import LoraConfig, get_peft_model

        loaded = load_model(model)
        self.model = model
        self.pollers = 1  # concurrent polling loops (until_served)
        self.full, self.tokenizer = loaded.model, loaded.tokenizer
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0)
        self.peft = get_peft_model(copy.deepcopy(loaded.model), config)
        self.torch = torch
        self.client = bus.redis_client(redis_url, timeout_s=30)
        self.transport = SharedDiskTransport(root, self.client)
        self.version = 0
        self.full_dirs: list[str] = []

    def write(self, adapter: str | None, tenant: str | None) -> Published:
        """The next version: a fresh random adapter, or the base with a perturbed weight."""
        torch = self.torch
        self.version += 1
        generator = torch.Generator().manual_seed(self.version)
        started = time.perf_counter()
        with torch.no_grad():
            if adapter is not None:
                for name, param in self.peft.named_parameters():
                    if "lora_" in name:
                        param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
                path = self.transport.write_adapter(self.version, self.peft, adapter, tenant=tenant)
            else:
                head = self.full.get_output_embeddings().weight  # tied to the embeddings
                head.add_(torch.randn(head.shape, generator=generator) * 1e-4)
                path = self.transport.write(self.version, self.full, self.tokenizer)
                self.full_dirs.append(path)
                for old in self.full_dirs[:-2]:  # the server holds what it loaded in memory
                    shutil.rmtree(old, ignore_errors=True)
                del self.full_dirs[:-2]
        return Published(self.version, path, adapter, tenant, time.perf_counter() - started)

    async def announce(self, pub: Published) -> None:
        """XADD the version's announcement on liveloop:weights (stamped just before)."""
        kind = "adapter" if pub.adapter is not None else "full"
        ann = WeightsAnnouncement(
            version=pub.version, path=pub.path, kind=kind, adapter=pub.adapter, tenant=pub.tenant
        )
        pub.announced_at = time.time()
        await self.transport.announce(ann)


def is_token(line: str) -> bool:
    """An SSE event carrying generated text (the role-only chunk comes with the first)."""
    return line.startswith("data: {") and '"content":"' in line and '"content":""' not in line


def chat_body(model: str, max_tokens: int, text: str = PROMPT) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "stream": True,
            "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}  # fmt: skip


def headers_for(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "X-LiveLoop-Train": "false"}


async def first_token(
    http: httpx.AsyncClient, key: str, model: str, nonce: str
) -> tuple[dict[str, str], float]:
    """The response headers of a one-token streamed request, and its token's arrival."""
    body = chat_body(model, 1, f"Request {nonce}: say something.")
    async with http.stream(
        "POST", "/v1/chat/completions", json=body, headers=headers_for(key)
    ) as r:
        if r.status_code != 200:
            raise RuntimeError(f"chat request failed: {r.status_code} {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):  # the role chunk goes out with the first token
                return {k.lower(): v for k, v in r.headers.items()}, time.time()
    raise RuntimeError("stream ended without a token")


async def until_served(
    http: httpx.AsyncClient, pub: Published, key: str, model: str, pollers: int
) -> tuple[float, float]:
    """First-token time of the first request that ran on `pub`'s version, and the median
    latency of the polling requests: `pollers` loops of one request at a time, started a
    little apart, each prompt its own (see the module doc)."""
    took: list[float] = []

    async def poll(index: int) -> float:
        await asyncio.sleep(index * 0.1)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            started = time.time()
            nonce = f"{index}.{len(took)}.{started:.3f}"
            head, at = await first_token(http, key, model, nonce)
            took.append(at - started)
            ok = head.get("x-policy-version") == str(pub.version)
            if ok and head.get("x-policy-adapter") == pub.adapter:
                return at
        raise RuntimeError(f"version {pub.version} never served")

    tasks = [asyncio.create_task(poll(i)) for i in range(pollers)]
    try:
        done, _pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        found = min(task.result() for task in done)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return found, statistics.median(took)


async def admin_weights(http: httpx.AsyncClient) -> dict[str, Any]:
    resp = await http.get("/admin/weights", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    resp.raise_for_status()
    result: dict[str, Any] = resp.json()
    return result


async def until_loaded(http: httpx.AsyncClient, pub: Published) -> tuple[float, dict[str, Any]]:
    """When GET /admin/weights first shows the version (polled every 25 ms), and its history
    entry (`loaded_at`: the server's own stamp; `pause_s`: the decode pause)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        weights = await admin_weights(http)
        if pub.adapter is None:
            served = weights["version"]
        else:
            served = weights["adapters"].get(pub.adapter, {}).get("version")
        if served == pub.version:
            seen = time.time()
            entry = [h for h in weights["history"] if h["version"] == pub.version]
            return seen, entry[-1] if entry else {}
        await asyncio.sleep(0.025)
    raise RuntimeError(f"version {pub.version} never loaded: {weights.get('refused')}")


async def announce_to_token(
    http: httpx.AsyncClient, publisher: Publisher, adapter: str | None
) -> dict[str, float]:
    """Publish one version of `adapter` (None: merged weights) and time its way to traffic."""
    tenant = tenant_id(key_of(adapter)) if adapter else None
    pub = await asyncio.to_thread(publisher.write, adapter, tenant)
    key = key_of(adapter) if adapter else BASE_KEY
    await publisher.announce(pub)
    (seen, entry), (token_at, poll_s) = await asyncio.gather(
        until_loaded(http, pub), until_served(http, pub, key, publisher.model, publisher.pollers)
    )
    return {
        "write_s": pub.write_s,
        "to_first_token_s": token_at - pub.announced_at,
        "to_loaded_admin_s": seen - pub.announced_at,
        "to_loaded_server_s": float(entry.get("loaded_at", seen)) - pub.announced_at,
        "pause_s": float(entry.get("pause_s", 0.0)),
        "poll_request_s": poll_s,
        "checkpoint_mb": dir_mb(pub.path),
    }


def dir_mb(path: str) -> float:
    files = [f for f in Path(path).rglob("*") if f.is_file()]
    return sum(f.stat().st_size for f in files) / 2**20


async def stream_times(http: httpx.AsyncClient, key: str, model: str, times: list[float]) -> None:
    """One long stream; appends each token's arrival until cancelled (ending is a failure)."""
    body = chat_body(model, 1500)
    async with http.stream(
        "POST", "/v1/chat/completions", json=body, headers=headers_for(key)
    ) as r:
        if r.status_code != 200:
            raise RuntimeError(f"stream failed: {r.status_code}")
        async for line in r.aiter_lines():
            if is_token(line):
                times.append(time.time())
            elif '"error"' in line:
                raise RuntimeError(f"stream error: {line[:200]}")
    raise RuntimeError("stream ended before the window did")


def max_gap_in(times: list[float], start: float, end: float) -> float:
    """Largest gap between consecutive tokens overlapping [start, end]."""
    gaps = [b - a for a, b in itertools.pairwise(times) if b >= start and a <= end]
    return max(gaps, default=0.0)


async def gap_run(
    http: httpx.AsyncClient,
    model: str,
    streams: int,
    window: Callable[[], Awaitable[tuple[float, float]]],
) -> dict[str, Any]:
    """Other tenants' streams decoding across `window` (an update, or a quiet wait)."""
    keys = [key_of(a) for a in OTHER_ADAPTERS] + [BASE_KEY]
    times: list[list[float]] = [[] for _ in range(streams)]
    tasks = [
        asyncio.create_task(stream_times(http, keys[i % len(keys)], model, times[i]))
        for i in range(streams)
    ]
    deadline = time.monotonic() + 120
    while min(len(t) for t in times) < 4 and not any(t.done() for t in tasks):
        if time.monotonic() > deadline:
            raise RuntimeError("streams did not start")
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.5)
    start, end = await window()
    await asyncio.sleep(0.3)
    failures = [str(t.exception()) for t in tasks if t.done() and t.exception() is not None]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    steps = [b - a for t in times for a, b in itertools.pairwise(t) if b < start]
    return {
        "window_s": end - start,
        "max_gap_s": max(max_gap_in(t, start, end) for t in times),
        "decode_step_s": statistics.median(steps) if steps else 0.0,
        "failed": len(failures),
        "failures": failures[:3],
    }


async def gap_round(
    http: httpx.AsyncClient, publisher: Publisher, streams: int, adapter: str | None
) -> dict[str, Any]:
    """An update of `adapter` (None: merged weights) under load, then a quiet twin window."""
    tenant = tenant_id(key_of(adapter)) if adapter else None
    pub = await asyncio.to_thread(publisher.write, adapter, tenant)  # before the streams

    pause: list[float] = []

    async def update() -> tuple[float, float]:
        await publisher.announce(pub)
        seen, entry = await until_loaded(http, pub)
        pause.append(float(entry.get("pause_s", 0.0)))
        return pub.announced_at, seen

    updated = {**await gap_run(http, publisher.model, streams, update), "pause_s": pause[0]}

    async def quiet() -> tuple[float, float]:
        start, end = time.time(), time.time() + updated["window_s"]
        while time.time() < end:  # the same admin polling as during the update
            await admin_weights(http)
            await asyncio.sleep(0.025)
        return start, time.time()

    undisturbed = await gap_run(http, publisher.model, streams, quiet)
    return {"update": updated, "quiet": undisturbed}


def med(values: list[float], digits: int = 4) -> float:
    return round(statistics.median(values), digits)


def summarize_latency(rounds: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for metric in rounds[0]["adapter"]:
        out[metric] = {
            kind: med([r[kind][metric] for r in rounds]) for kind in ("adapter", "merged")
        }
    ratios = [r["merged"]["to_first_token_s"] / r["adapter"]["to_first_token_s"] for r in rounds]
    out["merged_over_adapter_to_first_token"] = med(ratios, 2)
    out["all_rounds_to_first_token_s"] = {
        kind: [round(r[kind]["to_first_token_s"], 3) for r in rounds]
        for kind in ("adapter", "merged")
    }
    return out


def summarize_gaps(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("adapter", "merged"):
        upd = [r[kind]["update"] for r in rounds]
        qui = [r[kind]["quiet"] for r in rounds]
        out[kind] = {
            "window_s_median": med([u["window_s"] for u in upd]),
            "max_gap_during_update_s": [round(u["max_gap_s"], 4) for u in upd],
            "max_gap_quiet_same_length_s": [round(q["max_gap_s"], 4) for q in qui],
            "decode_step_s_median": med([u["decode_step_s"] for u in upd + qui]),
            "engine_pause_s": [round(u["pause_s"], 4) for u in upd],
            "update_minus_quiet_s_median": med(
                [u["max_gap_s"] - q["max_gap_s"] for u, q in zip(upd, qui, strict=True)]
            ),
            "failed_requests": sum(
                u["failed"] + q["failed"] for u, q in zip(upd, qui, strict=True)
            ),
            "failures": [f for x in upd + qui for f in x["failures"]][:3],
        }
    return out


def start_server(model: str, data_dir: Path, threads: int | None) -> Supervisor:
    keys = [key_of(a) for a in (UPDATED, *OTHER_ADAPTERS)] + [BASE_KEY]
    settings = LiveLoopSettings(model=model, data_dir=data_dir, port=free_port(), redis_url=None)
    env = {"LIVELOOP_API_KEYS": ",".join(keys), "LIVELOOP_ADMIN_KEY": ADMIN_KEY,
           "LIVELOOP_SERVER__MAX_LOADED_ADAPTERS": "8"}  # fmt: skip
    if threads:
        env["LIVELOOP_SERVER__TORCH_THREADS"] = str(threads)
    supervisor = Supervisor(settings, loops=("serve",), extra_env=env)
    supervisor.start()
    wait_ready(supervisor.base_url, supervisor, timeout_s=600)
    return supervisor


async def alternating(
    rounds: int, label: str, measure: Callable[[str | None], Awaitable[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """`measure(adapter)` per kind and round, the kinds' order alternating per round."""
    out = []
    for index in range(rounds):
        kinds = ("adapter", "merged") if index % 2 == 0 else ("merged", "adapter")
        result = {}
        for kind in kinds:
            result[kind] = await measure(UPDATED if kind == "adapter" else None)
            log(f"{label} round {index} {kind}: {json.dumps(result[kind])}")
        out.append(result)
    return out


async def bench_model(model: str, args: argparse.Namespace, data_dir: Path) -> dict[str, Any]:
    """One server on `model`: its adapters set up, then both measurements."""
    started = time.monotonic()
    supervisor = await asyncio.to_thread(
        start_server, model, data_dir / "server", args.torch_threads
    )
    log(f"{model}: server ready in {time.monotonic() - started:.0f}s at {supervisor.base_url}")
    publisher = Publisher(model, data_dir / "checkpoints", supervisor.redis_url, args.rank)
    publisher.pollers = args.pollers
    try:
        async with httpx.AsyncClient(base_url=supervisor.base_url, timeout=120.0) as http:
            for name in (UPDATED, *OTHER_ADAPTERS):  # every tenant's first version
                await announce_to_token(http, publisher, name)
            await announce_to_token(http, publisher, None)  # warm-up

            async def latency(adapter: str | None) -> dict[str, Any]:
                return await announce_to_token(http, publisher, adapter)

            async def gaps(adapter: str | None) -> dict[str, Any]:
                return await gap_round(http, publisher, args.streams, adapter)

            latency_rounds = await alternating(args.rounds, model, latency)
            gap_rounds = await alternating(args.gap_rounds, f"{model} gaps", gaps)
    finally:
        await publisher.client.aclose()
        await asyncio.to_thread(supervisor.stop)
    return {
        "model": model,
        "rounds": args.rounds,
        "gap_rounds": args.gap_rounds,
        "streams_during_update": args.streams,
        "announce_to_first_token": summarize_latency(latency_rounds),
        "other_streams_during_update": summarize_gaps(gap_rounds),
    }


def machine() -> dict[str, Any]:
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {"date": time.strftime("%Y-%m-%d"), "git_commit": commit,
            "platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "command": " ".join(["python", *sys.argv])}  # fmt: skip


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    results = []
    with tempfile.TemporaryDirectory(prefix="adapter-update-") as tmp:
        for model in args.models.split(","):
            results.append(await bench_model(model, args, Path(tmp) / model))
    return {
        **machine(),
        "what": "announcement (XADD) to the first token served by the new version, LoRA adapter "
        "vs merged full weights; other tenants' largest inter-token gap while it loads",
        "rank": args.rank,
        "torch_threads": args.torch_threads,
        "pollers": args.pollers,
        "models": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--models", default="smollm2-135m", help="comma-separated")
    parser.add_argument("--rounds", type=int, default=6, help="announce-to-token rounds")
    parser.add_argument("--gap-rounds", type=int, default=3, help="rounds of the gap runs")
    parser.add_argument("--streams", type=int, default=6, help="other streams during updates")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--pollers", type=int, default=1, help="request loops polling (see doc)")
    parser.add_argument("--torch-threads", type=int, default=None, help="server.torch_threads")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
