"""Benchmark of the promotion gate's baselines on a probe set that grows: kept replies reused,
against every probe answered again.

A refreshing probe source (`served`) draws its set again before every update while the set
is short, as for a tenant whose traffic is still growing, and version 0 and the serving
version are probed on each new set before the next candidate. This replays such a run: the
demo's held-out questions drawn as 9, 12, 16, 21 and 24 probes (the sizes a tenant's gate
drew in a 20-minute tenants demo), one update between draws (its LoRA adapters nudged, the
candidate probed and taken as accepted), side by side two ways: `kept` (the gate as it is:
version 0 and the serving version answer the probes new to them only) and `all_again`
(their kept replies dropped before each draw, so they answer the whole set, as the gate did
before each probe's reply was sampled with a seed of its own). Prints one JSON object.

    python bench/gate_refresh.py [--model smollm2-135m] [--threads 2] [--sizes 9,12,16,21,24]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gate import nudged_lora_policy
from liveloop.config import JudgeConfig, SharedSettings
from liveloop.config.gate import GateSettings
from liveloop.demo.gate_probes import HeldOutUsers
from liveloop.probe_sources import Probe, ProbeContext, ProbeSource
from liveloop.trainer.policy import Policy
from liveloop.trainer.safeguards.gate import PromotionGate, build_panel


class GrowingSet(ProbeSource):
    """The first `size` of a fixed list of probes: short until `size` reaches its length."""

    name = "growing"
    refreshes = True

    def __init__(self, context: ProbeContext, pool: list[Probe]) -> None:
        super().__init__(context)
        self.pool = pool
        self.size = 0

    async def draw(self) -> list[Probe]:
        return self.pool[: self.size]

    def fell_short(self, probes: list[Probe]) -> bool:
        return len(probes) < len(self.pool)


class CountingGate(PromotionGate):
    """A gate that records how many probes each version is sampled on, call by call."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sampled: list[tuple[int, int]] = []

    def _sample(self, policy: Policy, version: int, weights: Any, prompts: Any, seeds: Any) -> Any:
        self.sampled.append((version, len(prompts)))
        return super()._sample(policy, version, weights, prompts, seeds)

    @property
    def replies(self) -> int:
        """Replies sampled so far."""
        return sum(n for _, n in self.sampled)


def nudge(policy: Policy, seed: int) -> None:
    """One more small step of the adapters: the next version."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.add_(0.002 * torch.randn(param.shape, generator=generator))


async def replay(model: str, sizes: list[int], keep: bool) -> dict[str, Any]:
    """One run of draws and updates; the seconds and replies of the baselines per draw."""
    policy = nudged_lora_policy(model, seed=0)
    shared = SharedSettings(model=model)
    cfg = GateSettings(probe_source="demo", probe_users=max(sizes), second_draw=False)
    pool = await HeldOutUsers(ProbeContext(cfg, shared)).draw()
    source = GrowingSet(ProbeContext(cfg, shared), pool)
    gate = CountingGate(model, cfg, build_panel(JudgeConfig(), shared), source)
    source.size = sizes[0]
    started = time.perf_counter()
    await gate.start(policy, 0)
    draws = [{"probes": sizes[0], "seconds": time.perf_counter() - started,
              "replies": gate.replies}]  # fmt: skip
    candidate_s = 0.0
    for version, size in enumerate(sizes[1:], start=1):
        nudge(policy, version)
        started = time.perf_counter()
        verdict = await gate.assess(policy, version, policy.export())
        candidate_s += time.perf_counter() - started
        gate.accepted(verdict.on_first_set)
        if not keep:
            gate._kept.clear()
        source.size, before = size, gate.replies
        started = time.perf_counter()
        await gate.refresh(policy, version)
        draws.append({"probes": size, "seconds": time.perf_counter() - started,
                      "replies": gate.replies - before})  # fmt: skip
    return {
        "baseline_seconds": round(sum(d["seconds"] for d in draws), 1),
        "baseline_replies": sum(d["replies"] for d in draws),
        "candidate_seconds": round(candidate_s, 1),
        "draws": [{**d, "seconds": round(d["seconds"], 1)} for d in draws],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the demo's 2)")
    parser.add_argument("--sizes", default="9,12,16,21,24", help="probe set sizes, drawn in turn")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    sizes = [int(x) for x in args.sizes.split(",")]
    report: dict[str, Any] = {"model": args.model, "threads": args.threads, "sizes": sizes}
    asyncio.run(replay(args.model, sizes[:1], keep=True))  # warm-up: the first way pays no more
    for way, keep in (("kept", True), ("all_again", False)):
        report[way] = asyncio.run(replay(args.model, sizes, keep))
    kept, again = report["kept"]["baseline_seconds"], report["all_again"]["baseline_seconds"]
    report["baseline_seconds_saved"] = round(again - kept, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
