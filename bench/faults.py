"""Fault benchmark: crashes, outages, swaps under load, slow clients and fuzzing, counted.

Why: LiveLoop claims it keeps serving, loses no traffic and does nothing twice when parts
fail. Each scenario runs the real loops as processes on tiny-random (see `bench/fleet.py`),
breaks something, and prints one JSON line of figures counted from the streams, the
checkpoints and the registry (`bench/audit.py`). The fault tests in `tests/` run the same
scenarios shorter.

    python bench/faults.py                         # every scenario at full length
    python bench/faults.py kills --seconds 180     # 20+ SIGKILLs of judge/collector/trainer
    python bench/faults.py redis-outage --outage-s 30
    python bench/faults.py swaps --streams 200 --swaps 10
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fault_clients import run_slow_clients
from bench.fault_kills import run_campaign
from bench.fault_outages import run_redis_outage, run_server_crash
from bench.fault_swaps import run_swaps_under_load
from bench.fuzz import run_fuzz

Scenario = Callable[[Path, argparse.Namespace], list[dict[str, Any]]]


def _kills(root: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    return [
        run_campaign(
            root, seconds=args.seconds, min_kills=args.kills, agents=args.agents, seed=args.seed
        )
    ]


def _server_crash(root: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    return [run_server_crash(root, seconds=min(args.outage_s, 10.0), agents=args.agents)]


def _redis_outage(root: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    loops = ("serve", "judge", "collect", "train")
    return run_redis_outage(root, outage_s=args.outage_s, agents=args.agents, loops=loops)


def _swaps(root: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    return [run_swaps_under_load(root, streams=args.streams, swaps=args.swaps)]


def _slow_clients(root: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    return [run_slow_clients(root)]


def _fuzz(root: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    return [run_fuzz(root, max_examples=args.examples)]


SCENARIOS: dict[str, Scenario] = {
    "kills": _kills,
    "server-crash": _server_crash,
    "redis-outage": _redis_outage,
    "swaps": _swaps,
    "slow-clients": _slow_clients,
    "fuzz": _fuzz,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", nargs="*", choices=[*SCENARIOS, []], default=[])
    parser.add_argument("--seconds", type=float, default=180.0, help="traffic time of `kills`")
    parser.add_argument("--kills", type=int, default=20, help="least SIGKILLs of `kills`")
    parser.add_argument("--agents", type=int, default=4, help="concurrent simulated agents")
    parser.add_argument("--outage-s", type=float, default=30.0, help="Redis outage length")
    parser.add_argument("--streams", type=int, default=200, help="concurrent streams (swaps)")
    parser.add_argument("--swaps", type=int, default=10, help="valid checkpoints announced")
    parser.add_argument("--examples", type=int, default=200, help="schemathesis cases per op")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, help="keep the runs' data and logs here")
    args = parser.parse_args(argv)
    names = args.scenario or list(SCENARIOS)
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"faults-{name}-") as tmp:
            root = args.keep / name if args.keep else Path(tmp)
            started = time.monotonic()
            for figures in SCENARIOS[name](root, args):
                figures["wall_s"] = round(time.monotonic() - started, 1)
                print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
