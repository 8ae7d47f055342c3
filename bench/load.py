"""Load benchmark: `liveloop up` under many concurrent multi-turn sessions while it trains.

Why: the platform must sustain agent traffic for a long time while the trainer keeps
swapping weights into the server, without errors, without losing turns, and without any
process growing without bound. Each phase starts `liveloop up` (all four loops, supervised)
on a Valkey of its own, runs `--agents` simulated agents for `--seconds`, samples every
process's resident memory and Valkey's own `used_memory`, and reports requests/s, latency
and time to first token percentiles, errors, turns lost and duplicated (counted from the
retention archive and `liveloop:turns`), the newest version announced, the streams' lengths
and the archive's size at the end, and per process the memory at start, middle and end with
the growth in each half (levelling off = the second half grows much less than the first).
The phases run one after the other, side by side in one JSON line: stream retention off,
then on with a short window (`--window-s`), which is what keeps Valkey's memory level.

    python bench/load.py --seconds 240 --agents 16 --window-s 60 --out bench/results/load.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.audit import audit_turn_entries
from bench.fleet import ROOT, settings_env
from bench.traffic import Traffic, latency_summary
from liveloop.bus.archive import Archive
from liveloop.valkey import EmbeddedValkey, free_port

CONFIG: dict[str, Any] = {
    "prm": {"next_state_timeout_s": 5.0, "rules": {"timeout_score": 0.0}},
    "collector": {"min_turns": 16, "max_wait_s": 5.0, "group_wait_s": 0.2},
}
STREAMS = ("turns", "scored", "batches", "weights", "feedback")
PHASES = ("off", "on")


def retention_config(phase: str, window_s: float, interval_s: float) -> dict[str, Any]:
    """The `retention` section of a phase: off, or every stream with a window of `window_s`."""
    if phase == "off":
        return {"enabled": False}
    windows = dict.fromkeys((*STREAMS, "dead_letters"), window_s)
    keep = {"turns": 200, "scored": 200, "weights": 16}  # a short run: keep little
    return {"enabled": True, "interval_s": interval_s, "windows": windows, "keep_newest": keep}


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
    """RSS (MiB) of every process and Valkey's own `used_memory` (MiB) every `every_s`,
    until stopped."""
    samples: list[dict[str, float]] = []
    client = redis.Redis.from_url(valkey.url, decode_responses=True)
    while not stop.is_set():
        row = {"t": time.monotonic()}
        for name, proc in processes(up, valkey).items():
            with contextlib.suppress(psutil.Error):
                row[name] = proc.memory_info().rss / 2**20
        with contextlib.suppress(redis.RedisError):
            info: Any = client.info("memory")
            row["valkey_used_memory"] = int(info["used_memory"]) / 2**20
        samples.append(row)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
    client.close()
    return samples


NOISE_MB = {"valkey_used_memory": 1.0}  # Valkey's own count is exact; RSS moves by pages
RSS_NOISE_MB = 16.0


def memory_report(samples: list[dict[str, float]]) -> dict[str, Any]:
    """Per process (and Valkey's `used_memory`): MiB at start/middle/end, growth per half,
    and whether it levelled off (the second half grows at most half as much as the first,
    or less than the noise)."""
    names = sorted({k for s in samples for k in s if k != "t"})
    out: dict[str, Any] = {}
    for name in names:
        series = [s[name] for s in samples if name in s]
        if len(series) < 3:
            continue
        start, mid, end = series[0], series[len(series) // 2], series[-1]
        first, second = mid - start, end - mid
        out[name] = {
            "start": round(start, 1),
            "mid": round(mid, 1),
            "end": round(end, 1),
            "growth_first_half": round(first, 1),
            "growth_second_half": round(second, 1),
            "levels_off": second <= max(0.5 * first, NOISE_MB.get(name, RSS_NOISE_MB)),
        }
    return out


def timeline(
    samples: list[dict[str, float]], name: str, every_s: float = 30.0
) -> list[list[float]]:
    """[seconds since the start, MiB] of one series, about every `every_s`."""
    if not samples:
        return []
    t0, last, out = samples[0]["t"], float("-inf"), []
    for s in samples:
        if name in s and s["t"] - last >= every_s - 1e-6:
            out.append([round(s["t"] - t0), round(s[name], 2)])
            last = s["t"]
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


def recorded_turns(client: redis.Redis, archive: Path) -> Iterator[dict[str, Any]]:
    """The fields of every recorded turn, oldest first: the archive's, then the stream's."""
    start = "-"
    for entry_id, fields in Archive(archive).entries("liveloop:turns"):
        start = "(" + entry_id
        yield fields
    while page := client.xrange("liveloop:turns", min=start, count=2000):
        entries: Any = page
        yield from (fields for _id, fields in entries)
        start = "(" + str(entries[-1][0])


def end_state(client: redis.Redis, archive: Path) -> dict[str, Any]:
    """Stream lengths and memory, the newest version announced and the archive's size."""
    newest: Any = client.xrevrange("liveloop:weights", count=1)
    files = list(archive.rglob("*.jsonl.gz")) if archive.is_dir() else []
    memory: dict[str, float] = {}
    for name in STREAMS:
        used: Any = client.memory_usage(f"liveloop:{name}", samples=0)
        memory[name] = round((used or 0) / 2**20, 2)
    info: Any = client.info("memory")
    return {
        "stream_lengths": {name: int(client.xlen(f"liveloop:{name}")) for name in STREAMS},
        "stream_memory_mb": memory,
        "valkey_used_memory_mb_at_end": round(int(info["used_memory"]) / 2**20, 2),
        "newest_version_announced": json.loads(newest[0][1]["data"])["version"] if newest else 0,
        "archive_files": len(files),
        "archive_mb": round(sum(f.stat().st_size for f in files) / 2**20, 2),
    }


def run_phase(args: argparse.Namespace, phase: str) -> dict[str, Any]:
    """One `liveloop up` under load, retention `phase` ('off' or 'on'); its figures."""
    config = {**CONFIG, "retention": retention_config(phase, args.window_s, args.interval_s)}
    with tempfile.TemporaryDirectory(prefix="load-") as tmp:
        root = Path(tmp)
        valkey = EmbeddedValkey(root, port=free_port()).start()
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("LIVELOOP_")}
        env.update({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **settings_env(config)})
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
            turns = audit_turn_entries(
                recorded_turns(client, root / "data" / "archive"), traffic.served
            )
            state = end_state(client, root / "data" / "archive")
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
    return {
        "retention": config["retention"],
        "seconds": round(elapsed, 1),
        **summary,
        "requests_per_s": round(summary["requests"] / elapsed, 2),
        "errors": summary["failed"],
        "turns_lost": turns["lost"],
        "turns_duplicated": turns["duplicated"],
        "server_version_at_end": version,
        **state,
        "memory_mb": memory_report(samples),
        "valkey_used_memory_timeline": timeline(samples, "valkey_used_memory"),
    }


def run_context(argv: list[str] | None) -> dict[str, Any]:
    """When, on what and from which commit this run was made, and its command."""
    commit = subprocess.run(
        ["git", "describe", "--always", "--dirty", "--abbrev=12"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "machine": f"{platform.machine()}, {psutil.cpu_count()} CPUs, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB, {platform.system()}",
        "command": "python bench/load.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=180.0, help="length of each phase")
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--think-s", type=float, default=0.1, help="mean pause between turns")
    parser.add_argument("--sample-s", type=float, default=5.0, help="memory sampling period")
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument(
        "--phases", default="off,on", help="retention phases, in order (off, on or both)"
    )
    parser.add_argument("--window-s", type=float, default=60.0, help="retention window ('on')")
    parser.add_argument("--interval-s", type=float, default=15.0, help="retention pass period")
    parser.add_argument("--out", type=Path, help="also write the JSON to this file")
    args = parser.parse_args(argv)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if not phases or any(p not in PHASES for p in phases):
        parser.error("--phases takes off, on or both")
    result = {
        "bench": "load",
        **run_context(argv),
        "model": args.model,
        "agents": args.agents,
        "max_tokens": args.max_tokens,
        "phases": {},
    }
    for phase in phases:
        print(f"phase retention {phase}: {args.seconds:.0f} s", file=sys.stderr, flush=True)
        result["phases"][f"retention_{phase}"] = run_phase(args, phase)
    text = json.dumps(result)
    print(text, flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
