"""Load benchmark: `liveloop up` under many concurrent multi-turn sessions while it trains.

Why: the platform must sustain agent traffic for a long time while the trainer keeps
swapping weights into the server, without errors, without losing turns, and without any
process growing without bound. This starts `liveloop up` (all four loops, supervised) on
a Valkey of its own, runs `--agents` simulated agents for `--seconds`, samples every
process's resident memory, and prints one JSON line: requests/s, latency and time to first
token percentiles, errors, turns lost and duplicated (counted from `liveloop:turns`),
versions trained and swapped in, and per process the memory at start, middle and end with
the growth in each half (levelling off = the second half grows much less than the first).

    python bench/load.py --seconds 180 --agents 16
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.audit import audit_turns
from bench.fleet import ROOT, settings_env
from bench.traffic import Traffic, latency_summary
from liveloop.valkey import EmbeddedValkey, free_port

CONFIG: dict[str, Any] = {
    "prm": {"next_state_timeout_s": 5.0, "rules": {"timeout_score": 0.0}},
    "collector": {"min_turns": 16, "max_wait_s": 5.0, "group_wait_s": 0.2},
}
LOOP_MARKERS = {
    "serve": " serve ",
    "engine": "engine.worker",
    "judge": " judge ",
    "collect": " collect ",
    "train": " train ",
    "valkey": "valkey-server",
}


def processes(up: psutil.Process, valkey: EmbeddedValkey) -> dict[str, psutil.Process]:
    """The supervisor, its loops (and the engine worker) and Valkey, by name."""
    found = {"up": up}
    with contextlib.suppress(psutil.Error):
        for child in up.children(recursive=True):
            cmd = " " + " ".join(child.cmdline()) + " "
            for name, marker in LOOP_MARKERS.items():
                if marker in cmd and name not in found:
                    found[name] = child
    if valkey.process is not None:
        found["valkey"] = psutil.Process(valkey.process.pid)
    return found


async def sample_memory(
    up: psutil.Process, valkey: EmbeddedValkey, stop: asyncio.Event, every_s: float
) -> list[dict[str, float]]:
    """RSS (MiB) of every process every `every_s`, until stopped."""
    samples: list[dict[str, float]] = []
    while not stop.is_set():
        row = {"t": time.monotonic()}
        for name, proc in processes(up, valkey).items():
            with contextlib.suppress(psutil.Error):
                row[name] = proc.memory_info().rss / 2**20
        samples.append(row)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
    return samples


def memory_report(samples: list[dict[str, float]]) -> dict[str, Any]:
    """Per process: MiB at start/middle/end, growth per half, and whether it levelled off."""
    names = sorted({k for s in samples for k in s if k != "t"})
    out: dict[str, Any] = {}
    for name in names:
        series = [s[name] for s in samples if name in s]
        if len(series) < 3:
            continue
        start, mid, end = series[0], series[len(series) // 2], series[-1]
        first, second = mid - start, end - mid
        out[name] = {
            "start": round(start),
            "mid": round(mid),
            "end": round(end),
            "growth_first_half": round(first, 1),
            "growth_second_half": round(second, 1),
            "levels_off": second <= max(0.5 * first, 16.0),
        }
    return out


async def _run(base_url: str, args: argparse.Namespace, up: psutil.Process, valkey: EmbeddedValkey) -> tuple[Traffic, list[dict[str, float]]]:  # fmt: skip
    traffic = Traffic(
        base_url, agents=args.agents, turns_per_session=4, max_tokens=args.max_tokens,
        stream_share=0.5, think_s=args.think_s, timeout_s=120,
    )  # fmt: skip
    stop = asyncio.Event()
    memory = asyncio.create_task(sample_memory(up, valkey, stop, args.sample_s))
    task = asyncio.create_task(traffic.run(stop))
    await asyncio.sleep(args.seconds)
    stop.set()
    await task
    return traffic, await memory


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("liveloop up exited before it was ready")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError("liveloop up not ready in time")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--think-s", type=float, default=0.1, help="mean pause between turns")
    parser.add_argument("--sample-s", type=float, default=5.0, help="memory sampling period")
    parser.add_argument("--model", default="tiny-random")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="load-") as tmp:
        root = Path(tmp)
        valkey = EmbeddedValkey(root, port=free_port()).start()
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("LIVELOOP_")}
        env.update({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **settings_env(CONFIG)})
        argv_up = [sys.executable, "-m", "liveloop.cli", "up", "--model", args.model, "--quiet"]
        argv_up += ["--data-dir", str(root / "data"), "--redis-url", valkey.url]
        argv_up += ["--port", str(port), "--log-level", "WARNING"]
        log = open(root / "up.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(argv_up, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        base_url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(base_url, proc)
            started = time.monotonic()
            up = psutil.Process(proc.pid)
            traffic, samples = asyncio.run(_run(base_url, args, up, valkey))
            elapsed = time.monotonic() - started
            version = int(httpx.get(base_url + "/v1/models").headers["x-policy-version"])
            time.sleep(3.0)  # the trace writer's last records
            client = redis.Redis.from_url(valkey.url, decode_responses=True)
            turns = audit_turns(client, traffic.served)
            announced = client.xlen("liveloop:weights")
            client.close()
        finally:
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            if proc.poll() is None:
                proc.kill()
            log.close()
            valkey.stop()
        summary = latency_summary(traffic.served)
        print(json.dumps({
            "bench": "load",
            "model": args.model,
            "seconds": round(elapsed, 1),
            "agents": args.agents,
            "max_tokens": args.max_tokens,
            **summary,
            "requests_per_s": round(summary["requests"] / elapsed, 2),
            "errors": summary["failed"],
            "turns_lost": turns["lost"],
            "turns_duplicated": turns["duplicated"],
            "versions_announced": announced,
            "server_version_at_end": version,
            "rss_mb": memory_report(samples),
        }), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
