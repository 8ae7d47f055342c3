"""The least any HTTP server costs the engine on this machine: the floor under gateway.py.

Why: `gateway.py`'s targets (the server adds at most 2 ms to the median time to first token
and costs at most 5% tokens/s at 32 streams) are measured on a server that does real work
for each request. Where the engine already keeps every core busy, whatever CPU a server
uses comes out of the engine's. This measures the smallest such cost: the in-process engine
at N concurrent streams, alone against the same rounds while a bare uvicorn ASGI app (read
the body, parse the JSON, answer two SSE events; same event loop and HTTP parser as `liveloop
serve`) takes a burst of N requests at the same moment from a client in its own process.
Rounds are paired and interleaved as in `gateway.py`, with the same statistics. If this
floor alone comes near a target, no server that authenticates, renders, tokenizes and
records requests can meet it on this machine. Prints one JSON object to stdout.

    python bench/http_floor.py --streams 32 --rounds 60
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import httpx
import psutil
from gateway import (
    TARGET_TTFT_ADDED_MS,
    SSEClient,
    engine_stream,
    event_loop_factory,
    http_stream,
    messages_for,
)
from paired import Round, compare, judge

from liveloop.models import load_model
from liveloop.valkey import free_port

FIRST = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
LAST = b'data: {"choices":[],"usage":{"completion_tokens":1}}\n\ndata: [DONE]\n\n'


async def bare_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads the request, parses its JSON body and streams two events."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if body:
        json.loads(body)
    headers = [(b"content-type", b"text/event-stream")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": FIRST, "more_body": True})
    await send({"type": "http.response.body", "body": LAST, "more_body": False})


def serve(port: int) -> None:
    """Run the bare app (uvicorn picks uvloop and httptools, as for `liveloop serve`)."""
    import uvicorn

    config = uvicorn.Config(
        bare_app, host="127.0.0.1", port=port, log_config=None, access_log=False
    )
    uvicorn.Server(config).run()


async def fire(port: int, streams: int) -> None:
    """For each line on stdin, send a burst of `streams` requests; a line out when done."""
    client = SSEClient(f"http://127.0.0.1:{port}")
    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    while await loop.run_in_executor(None, sys.stdin.readline):
        await asyncio.gather(*(http_stream(client, "bare", i, 1) for i in range(streams)))
        print("done", flush=True)
    await client.close()


def spawn(*args: str, **kwargs: Any) -> subprocess.Popen[bytes]:
    """This script again, in one of its helper modes."""
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args], **kwargs)


class BurstClient:
    """The `--fire` helper: bursts of requests from a process of their own, so that the
    client's work does not share the in-process engine's interpreter lock."""

    def __init__(self, port: int, streams: int) -> None:
        self.proc = spawn("--fire", str(port), "--streams", str(streams),
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin: IO[bytes] = self.proc.stdin
        self.stdout: IO[bytes] = self.proc.stdout
        self.stdout.readline()  # ready

    async def burst(self) -> None:
        """One burst; returns when every request of it is answered."""
        self.stdin.write(b"go\n")
        self.stdin.flush()
        if await asyncio.to_thread(self.stdout.readline) != b"done\n":
            raise SystemExit(f"the burst client exited (code {self.proc.poll()})")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def wait_ready(url: str) -> None:
    """Until the bare server answers."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit("the bare server did not start")


async def one_round(
    engine: Any, prompts: dict[int, list[int]], max_tokens: int, burst: BurstClient | None
) -> Round:
    """The in-process streams of one round, with a burst to the bare server at the same moment."""
    jobs = [engine_stream(engine, prompt, seed, max_tokens) for seed, prompt in prompts.items()]
    if burst is None:
        return list(await asyncio.gather(*jobs))
    *streams, _ = await asyncio.gather(*jobs, burst.burst())
    return list(streams)


async def measure(args: argparse.Namespace, server: psutil.Process) -> dict[str, Any]:
    """Paired rounds: the engine alone, and the engine while the bare server takes a burst."""
    from liveloop.server.engine import TorchEngine
    from liveloop.server.tools import ChatTemplate

    loaded = load_model(args.model, "cpu")
    template = ChatTemplate(loaded.tokenizer)
    engine = TorchEngine(loaded.model, loaded.tokenizer, max_batch_size=args.streams)
    await engine.start()
    client = BurstClient(args.port, args.streams)
    runs: dict[bool, list[Round]] = {False: [], True: []}
    cpu = 0.0
    try:
        for rnd in range(-2, args.rounds):  # two rounds of warm-up
            seeds = [(rnd + 2) * 1000 + i for i in range(args.streams)]
            prompts = {s: template.render_ids(messages_for(s), None) for s in seeds}
            for with_burst in (False, True) if rnd % 2 == 0 else (True, False):
                before = sum(server.cpu_times()[:2])
                result = await one_round(
                    engine, prompts, args.max_tokens, client if with_burst else None
                )
                if rnd >= 0:
                    runs[with_burst].append(result)
                    if with_burst:
                        cpu += sum(server.cpu_times()[:2]) - before
    finally:
        client.close()
        await engine.stop()
    out = compare(runs[False], runs[True], names=("engine_alone", "engine_with_burst"))
    out["bare_server_cpu_ms_per_request"] = round(1e3 * cpu / (args.rounds * args.streams), 3)
    return out


def main() -> None:
    """Run the floor benchmark (or, with --serve / --fire, one of its helpers)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--fire", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    if args.fire:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            runner.run(fire(args.fire, args.streams))
        return
    args.port = free_port()
    server = spawn("--serve", str(args.port))
    try:
        wait_ready(f"http://127.0.0.1:{args.port}/")
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            results = runner.run(measure(args, psutil.Process(server.pid)))
    finally:
        server.terminate()
        server.wait(30)
    target = judge(
        results["ttft_ms_p50_added"], results["ttft_ms_p50_added_ci95"], TARGET_TTFT_ADDED_MS
    )
    out = {
        "model": args.model, "streams": args.streams, "rounds": args.rounds,
        "max_tokens": args.max_tokens, "cpu_count": os.cpu_count(),
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2), "results": results,
        "gateway_ttft_target_vs_this_floor": target,
    }  # fmt: skip
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
