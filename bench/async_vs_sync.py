"""Trained samples per minute, asynchronous (max_staleness 4) vs synchronous (max_staleness 0).

Prints one JSON object. Both modes run the same workload against the real collecting and
training loops (`liveloop collect` and `liveloop train` as separate processes on an
embedded Valkey, tiny-random model, default settings except `max_staleness`), and differ
only in `max_staleness` (a top-level setting), which both loops apply.

The generator is a simulation of the serving loop, faithful in the three respects that
decide this comparison, and runs in this process:
- Continuous batching: `--slots` requests decode together; every `--token-ms` each running
  request emits one token, and a finished request's slot is refilled at once (agents that
  always have the next request ready). Generation never waits for the trainer.
- Long-tailed response lengths: completions are log-normal with a median of `--median-len`
  tokens and sigma `--sigma` (capped at 1024): most answers are short, a few are very long.
- Hot-swapped weights: the generator follows `liveloop:weights` (polled every 50 ms) and
  tags every token with the version being served when it was generated, as the server
  does, so a response that spans a swap carries two versions and its oldest one decides
  its staleness.
Finished turns are judged instantly (a random score in [-1, 1]) and written to
`liveloop:scored`; the behaviour log-probs are log(1/vocab), which is what the randomly
initialised tiny-random model assigns to any token to within a few percent.

With max_staleness 0 every turn that was in flight when a new version went live is
discarded, and the trainer discards batches collected under the previous version, so
each version must wait for a fresh set of complete responses: long responses rarely make
it, and generation time and training time add up. With max_staleness 4 they overlap.

The default workload (4 slots, 10 ms per token, median 48 tokens, sigma 1) generates about
5 turns (1,200 tokens) per second, about what the trainer trains per second on tiny-random
on a small shared CPU: the balanced regime a deployment aims for. When generation far
outpaces training (or the reverse), both modes are bound by the slower side and the gap
narrows; `--slots` and `--token-ms` move that balance.

Each mode runs until its first version is announced, then for `--seconds`; the rate is
the number of samples in the updates announced within that window.

    python bench/async_vs_sync.py [--seconds 60] [--slots 4] [--token-ms 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# `python bench/async_vs_sync.py` puts bench/ first on sys.path; bench/trainer.py there
# would shadow the `trainer` package, so the repository root goes there instead.
ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(ROOT)

import redis.asyncio as aredis  # noqa: E402

from liveloop import bus  # noqa: E402
from liveloop.contracts import ScoredTurn, WeightsAnnouncement  # noqa: E402
from liveloop.valkey import EmbeddedValkey  # noqa: E402
from liveloop.weights import latest_announcement  # noqa: E402

VOCAB = 49152
BEHAVIOUR_LOGPROB = -math.log(VOCAB)


@dataclass
class Request:
    """One simulated request being decoded."""

    rid: int
    prompt: list[int]
    length: int
    versions: list[int] = field(default_factory=list)


class SimulatedServer:
    """Continuous-batching generation that follows `liveloop:weights` (see module doc)."""

    def __init__(self, client: aredis.Redis, args: argparse.Namespace, seed: int) -> None:
        self.client = client
        self.args = args
        self.rng = random.Random(seed)
        self.version = 0
        self.turns_generated = 0
        self.next_id = 0

    def _new_request(self) -> Request:
        self.next_id += 1
        prompt = [self.rng.randrange(3, VOCAB) for _ in range(self.rng.randint(64, 256))]
        raw = self.rng.lognormvariate(math.log(self.args.median_len), self.args.sigma)
        return Request(self.next_id, prompt, max(1, min(1024, int(raw))))

    async def follow_versions(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            latest = await latest_announcement(self.client)
            self.version = latest.version if latest is not None else 0
            await asyncio.sleep(0.05)

    def _turn(self, req: Request) -> ScoredTurn:
        completion = [self.rng.randrange(3, VOCAB) for _ in range(req.length)]
        return ScoredTurn(
            session_id=f"sim-{req.rid}",
            turn_index=0,
            tenant="bench",
            request_id=f"req-{req.rid}",
            messages=[{"role": "user", "content": "simulated"}],
            prompt_token_ids=req.prompt,
            completion_token_ids=completion,
            logprobs=[BEHAVIOUR_LOGPROB] * req.length,
            versions=req.versions,
            finish_reason="stop",
            model="tiny-random",
            score=self.rng.uniform(-1, 1),
            judge="sim",
        )

    async def generate(self, stop: asyncio.Event) -> None:
        step_s = self.args.token_ms / 1000
        active = [self._new_request() for _ in range(self.args.slots)]
        next_step = time.monotonic()
        while not stop.is_set():
            for req in active:
                req.versions.append(self.version)
            for i, req in enumerate(active):
                if len(req.versions) >= req.length:
                    await bus.publish(self.client, bus.SCORED, self._turn(req))
                    self.turns_generated += 1
                    active[i] = self._new_request()
            next_step += step_s
            await asyncio.sleep(max(0.0, next_step - time.monotonic()))


def start_loop(
    command: str, redis_url: str, data_dir: Path, staleness: int, log_level: str
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "LIVELOOP_MAX_STALENESS": str(staleness),
        # No n > 1 groups in this workload: don't hold turns for group mates (either mode).
        "LIVELOOP_COLLECTOR__GROUP_WAIT_S": "0",
        "LIVELOOP_COLLECTOR__VERSION_POLL_S": "0.05",
    }
    args = [sys.executable, "-m", "liveloop.cli", command, "--model", "tiny-random"]
    args += ["--redis-url", redis_url, "--data-dir", str(data_dir), "--log-level", log_level]
    return subprocess.Popen(args, cwd=ROOT, env=env)


def stop_loop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def announcements(client: aredis.Redis) -> list[WeightsAnnouncement]:
    entries: Any = await client.xrange(bus.stream_key(bus.WEIGHTS))
    return [bus.decode(f, WeightsAnnouncement) for _id, f in entries]


async def run_mode(redis_url: str, staleness: int, args: argparse.Namespace) -> dict[str, float]:
    client = bus.redis_client(redis_url)
    await client.flushdb()
    server = SimulatedServer(client, args, seed=args.seed)
    with tempfile.TemporaryDirectory(prefix="liveloop-bench-") as tmp:
        procs = [
            start_loop(c, redis_url, Path(tmp), staleness, args.log_level)
            for c in ("collect", "train")
        ]
        stop = asyncio.Event()
        tasks = [asyncio.create_task(server.follow_versions(stop))]
        tasks.append(asyncio.create_task(server.generate(stop)))
        try:
            deadline = time.monotonic() + args.startup_timeout
            while not await announcements(client):
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"no first version with max_staleness={staleness}")
                await asyncio.sleep(0.2)
            window_start = time.time()
            turns_before = server.turns_generated
            await asyncio.sleep(args.seconds)
            window_end = time.time()
            turns_in_window = server.turns_generated - turns_before
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            for p in procs:
                stop_loop(p)
    got = [a for a in await announcements(client) if window_start < a.created_at <= window_end]
    await client.aclose()
    samples = sum(a.metrics.get("samples", 0) for a in got)
    tokens = sum(a.metrics.get("forward_tokens", 0) for a in got)
    minutes = (window_end - window_start) / 60
    return {
        "max_staleness": staleness,
        "versions": len(got),
        "trained_samples": samples,
        "generated_turns": turns_in_window,
        "trained_samples_per_min": round(samples / minutes, 1),
        "trained_tokens_per_min": round(tokens / minutes, 1),
        "used_fraction": round(samples / turns_in_window, 3) if turns_in_window else 0.0,
    }


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="liveloop-valkey-") as tmp:
        valkey = EmbeddedValkey(Path(tmp))
        valkey.start()
        try:
            modes = args.modes.split(",")
            sync = await run_mode(valkey.url, 0, args) if "sync" in modes else {}
            asynchronous = (
                await run_mode(valkey.url, args.staleness, args) if "async" in modes else {}
            )
        finally:
            valkey.stop()
    ratio = None
    if sync and asynchronous:
        ratio = asynchronous["trained_samples_per_min"] / max(sync["trained_samples_per_min"], 1e-9)
    print(
        json.dumps(
            {
                "benchmark": "async_vs_sync",
                "workload": {
                    "slots": args.slots,
                    "token_ms": args.token_ms,
                    "median_len": args.median_len,
                    "sigma": args.sigma,
                    "seconds": args.seconds,
                },
                "sync": sync,
                "async": asynchronous,
                "speedup_samples_per_min": round(ratio, 2) if ratio is not None else None,
                "target_speedup": 1.8,
                "meets_target": ratio is not None and ratio >= 1.8,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="measured window per mode")
    parser.add_argument("--slots", type=int, default=4, help="requests decoded together")
    parser.add_argument("--token-ms", type=float, default=10.0, help="time per decode step")
    parser.add_argument("--median-len", type=float, default=48.0, help="median completion")
    parser.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of lengths")
    parser.add_argument("--staleness", type=int, default=4, help="max_staleness, async mode")
    parser.add_argument("--startup-timeout", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-level", default="WARNING", help="of the collector and trainer")
    parser.add_argument("--modes", default="sync,async", help="which modes to run")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
