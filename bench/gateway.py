"""Benchmark of what the HTTP server adds on top of the engine it wraps.

Why: agents talk to the engine through the OpenAI-compatible server (auth, sessions,
token-exact trace capture, SSE). This measures time to first token, end-to-end latency
and generated tokens/s for streamed requests through a real `liveloop serve` subprocess
(embedded Valkey, trace capture on, the engine in its worker process) against calling a
TorchEngine on the same model in-process, in the same run, rounds interleaved, at 1 and
32 concurrent streams. The overhead figures are medians of per-round paired differences,
each with a 95% confidence interval (`paired.py`). Target: the server adds at most 2 ms to
the median TTFT and costs at most 5% tokens/s at 32 streams; a target's verdict is "within
noise" when its interval straddles it (more rounds narrow it). Prints one JSON object to
stdout; progress goes to stderr.

    python bench/gateway.py --model tiny-random --max-tokens 64 --rounds 5 --single-rounds 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import httpx
from paired import Round, compare, judge

from liveloop.models import load_model
from liveloop.valkey import EmbeddedValkey, free_port

QUESTION = "Explain how a CPU cache works, with one example."
TARGET_TTFT_ADDED_MS = 2.0
TARGET_TPS_DROP_PCT = 5.0


def messages_for(seed: int) -> list[dict[str, str]]:
    """A request's messages: each one different, as a server sees them (nothing cached whole)."""
    return [{"role": "user", "content": f"{QUESTION} (request {seed})"}]


def log(msg: str) -> None:
    """Progress to stderr."""
    print(msg, file=sys.stderr, flush=True)


def start_server(
    args: argparse.Namespace, redis_url: str, data_dir: Path
) -> tuple[subprocess.Popen[bytes], str]:
    """`liveloop serve` on a free port; returns the process and its base URL once ready."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVELOOP_")}
    env.update(
        PYTHONPATH=str(Path(__file__).resolve().parent.parent),
        LIVELOOP_SERVER__MAX_BATCH_SIZE=str(args.max_batch_size),
        LIVELOOP_SERVER__DEVICE=args.device,
        LIVELOOP_LOG_LEVEL="WARNING",
    )
    cmd = [
        sys.executable,
        "-m",
        "liveloop.cli",
        "serve",
        "--model",
        args.model,
        "--port",
        str(port),
    ]
    cmd += ["--redis-url", redis_url, "--data-dir", str(data_dir)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become ready")


class SSEConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection that reads streamed chat completions.

    The response is parsed where the bytes arrive (`data_received`), with no reader task
    to wake per token: chunked framing is undone, and only what is measured is decoded
    (the first events, until text arrives, and the usage event).
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[dict[str, float]] | None = None
        self.buffer = b""
        self.in_body = False
        self.started = self.first = 0.0
        self.tokens = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError(f"the server closed the connection: {exc}"))

    def request(self, request: bytes) -> asyncio.Future[dict[str, float]]:
        """Send one request; the future gives its TTFT, end-to-end seconds and tokens."""
        assert self.transport is not None
        self.done = asyncio.get_running_loop().create_future()
        self.buffer, self.in_body, self.first, self.tokens = b"", False, 0.0, 0
        self.started = time.perf_counter()
        self.transport.write(request)
        return self.done

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.in_body:
            head, sep, rest = self.buffer.partition(b"\r\n\r\n")
            if not sep:
                return
            if head.split(b" ", 2)[1] != b"200":
                self._finish(RuntimeError(f"server answered {head.splitlines()[0].decode()}"))
                if self.transport is not None:
                    self.transport.close()  # the rest of that response is not read
                return
            self.buffer, self.in_body = rest, True
        while True:
            eol = self.buffer.find(b"\r\n")
            if eol < 0:
                return
            size = int(self.buffer[:eol], 16)
            end = eol + 2 + size
            if len(self.buffer) < end + 2:
                return
            body, self.buffer = self.buffer[eol + 2 : end], self.buffer[end + 2 :]
            if size == 0:
                self._finish(None)
                return
            self._events(body)

    def _events(self, body: bytes) -> None:
        if not self.first:
            for event in body.split(b"\n\n"):
                if event.startswith(b"data: {"):
                    chunk = json.loads(event[6:])
                    if any(c["delta"].get("content") for c in chunk["choices"]):
                        self.first = time.perf_counter()
                        break
        if b'"usage":{' in body:
            for event in body.split(b"\n\n"):
                if b'"usage":{' in event and event.startswith(b"data: {"):
                    self.tokens = json.loads(event[6:])["usage"]["completion_tokens"]

    def _finish(self, error: Exception | None) -> None:
        assert self.done is not None
        if error is not None:
            self.done.set_exception(error)
            return
        end = time.perf_counter()
        first = self.first or end
        self.done.set_result(
            {"ttft": first - self.started, "e2e": end - self.started, "tokens": self.tokens}
        )


class SSEClient:
    """A pool of `SSEConnection`s to the server.

    httpx's own overhead dominated the first measurements (32 concurrent GETs of a bare
    FastAPI app took ~300 ms through httpx.AsyncClient and ~18 ms over raw sockets on the
    2-core test box), and on two cores every CPU-second the client spends is taken from the
    engine, so the client side is kept as thin as possible: what is measured is the server,
    not the client library.
    """

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        self.idle: list[SSEConnection] = []

    async def close(self) -> None:
        """Close the pooled connections."""
        for conn in self.idle:
            if conn.transport is not None:
                conn.transport.close()
        self.idle.clear()

    async def stream(self, body: dict[str, Any]) -> dict[str, float]:
        """POST one streamed request; its TTFT, end-to-end seconds and completion tokens."""
        payload = json.dumps(body).encode()
        request = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {self.host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode() + payload
        while True:
            fresh = not self.idle
            if fresh:
                loop = asyncio.get_running_loop()
                _, conn = await loop.create_connection(SSEConnection, self.host, self.port)
            else:
                conn = self.idle.pop()
                if conn.transport is None or conn.transport.is_closing():
                    continue  # the server closed it (keep-alive timeout)
            try:
                result = await conn.request(request)
            except ConnectionError:
                if fresh:
                    raise
                continue  # closed by the server just as the request went out
            self.idle.append(conn)
            return result


async def http_stream(
    client: SSEClient, model: str, seed: int, max_tokens: int
) -> dict[str, float]:
    """One streamed request through the server: TTFT, end-to-end seconds, tokens."""
    body = {
        "model": model, "messages": messages_for(seed), "max_tokens": max_tokens, "seed": seed,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    }  # fmt: skip
    return await client.stream(body)


async def engine_stream(
    engine: Any, prompt: list[int], seed: int, max_tokens: int
) -> dict[str, float]:
    """One request straight to the in-process engine."""
    from liveloop.server.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True)
    started = time.perf_counter()
    first = None
    tokens = 0
    async for _out in engine.generate(prompt, params):
        tokens += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return {"ttft": (first or end) - started, "e2e": end - started, "tokens": tokens}


async def measure(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """Interleaved rounds of both paths at every concurrency level."""
    from liveloop.server.engine import TorchEngine
    from liveloop.server.tools import ChatTemplate

    loaded = load_model(args.model, args.device)
    template = ChatTemplate(loaded.tokenizer)
    engine = TorchEngine(
        loaded.model, loaded.tokenizer, max_batch_size=args.max_batch_size, device=args.device
    )
    await engine.start()
    client = SSEClient(url)

    async def inprocess(seeds: list[int], max_tokens: int) -> list[dict[str, float]]:
        prompts = {s: template.render_ids(messages_for(s), None) for s in seeds}  # not timed
        return list(
            await asyncio.gather(*(engine_stream(engine, prompts[s], s, max_tokens) for s in seeds))
        )

    async def http(seeds: list[int], max_tokens: int) -> list[dict[str, float]]:
        return list(
            await asyncio.gather(*(http_stream(client, args.model, s, max_tokens) for s in seeds))
        )

    results: dict[str, Any] = {}
    try:
        for _ in range(2):  # warm both paths (allocator, caches, connections)
            await http(list(range(8)), 8)
            await inprocess(list(range(8)), 8)
        for level in args.concurrency:
            runs: dict[str, list[Round]] = {"inprocess": [], "http": []}
            rounds = args.rounds if level > 1 else max(args.rounds, args.single_rounds)
            for rnd in range(rounds):
                seeds = [rnd * 1000 + i for i in range(level)]
                pair = [("inprocess", inprocess), ("http", http)]
                for name, run in pair if rnd % 2 == 0 else pair[::-1]:  # alternate the order
                    runs[name].append(await run(seeds, args.max_tokens))
            results[str(level)] = compare(runs["inprocess"], runs["http"])
            log(f"{level} streams: {json.dumps(results[str(level)])}")
    finally:
        await client.close()
        await engine.stop()
    return results


def verdict(results: dict[str, Any], levels: list[int]) -> dict[str, Any]:
    """The targets and whether this run met them: TTFT at every level, tokens/s at the top."""
    out: dict[str, Any] = {}
    for level in levels:
        res = results[str(level)]
        out[f"ttft_ms_p50_added_at_{level}"] = judge(
            res["ttft_ms_p50_added"], res["ttft_ms_p50_added_ci95"], TARGET_TTFT_ADDED_MS
        )
    top = results[str(max(levels))]
    out[f"tokens_per_s_drop_pct_at_{max(levels)}"] = judge(
        top["tokens_per_s_drop_pct"], top["tokens_per_s_drop_pct_ci95"], TARGET_TPS_DROP_PCT
    )
    return out


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop where it is installed (as the server's is), else asyncio's own.

    The same loop runs both paths: the streams read from the server and the in-process
    engine's consumers.
    """
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main() -> None:
    """Run the benchmark and print its JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--single-rounds", type=int, default=30, help="rounds at 1 stream")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedValkey(Path(tmp)) as valkey:
        proc, url = start_server(args, valkey.url, Path(tmp) / "data")
        try:
            with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
                results = runner.run(measure(args, url))
        finally:
            proc.terminate()
            proc.wait(30)
    out = {
        "model": args.model, "device": args.device, "max_tokens": args.max_tokens,
        "rounds": args.rounds, "cpu_count": os.cpu_count(),
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2), "results": results,
        "targets": verdict(results, args.concurrency),
    }  # fmt: skip
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
