"""The trainer's resident memory over update cycles, with and without returning freed memory.

One cycle is what the trainer does per batch on the CPU, each step in a worker thread as
the loop runs it: a PPO update, the LoRA-merged copy the promotion gate probes, a few probe
replies sampled from that copy; then the copy is dropped. Each variant runs in a fresh process; after
every cycle it prints the process's RSS. `trim` calls `release_freed_memory()` after each
cycle, as the trainer loop does; `none` does not (the trainer before it).

    python bench/trainer_memory.py [--model qwen2.5-coder-0.5b] [--cycles 5]

Prints one JSON object: RSS in GB after each cycle, per variant.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def cycles(model: str, count: int, trim: bool) -> list[float]:
    """Run `count` cycles in this process; RSS (GB) after each."""
    import psutil

    from liveloop.config import load_settings, presets
    from liveloop.contracts import BatchSample
    from liveloop.trainer.dist import Comm
    from liveloop.trainer.memory import release_freed_memory
    from liveloop.trainer.policy import load_policy
    from liveloop.trainer.ppo import PPOUpdater
    from liveloop.trainer.safeguards.sampling import sample_replies

    cfg = load_settings([presets.demo_preset(model, None)], model=model).trainer
    policy = load_policy(model, "cpu", cfg.lora, with_reference=True)
    updater = PPOUpdater(policy, cfg, Comm(), model_name=model, cache={})
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 5000) for _ in range(250)] for _ in range(6)]

    def batch(k: int) -> list[BatchSample]:
        out = []
        for i in range(6):
            prompt = [rng.randrange(1, 5000) for _ in range(300 + rng.randint(0, 40))]
            completion = [rng.randrange(1, 5000) for _ in range(40)]
            out.append(BatchSample(
                key=f"{k}-{i}", prompt_token_ids=prompt, completion_token_ids=completion,
                logprobs=[-3.0] * 40, versions=[0] * 40, advantage=rng.uniform(-1, 1), score=0.0,
            ))  # fmt: skip
        return out

    def probe(merged: Any) -> None:
        sample_replies(
            merged,
            policy.tokenizer,
            prompts,
            max_tokens=24,
            temperature=1.0,
            seeds=range(len(prompts)),
        )

    async def run() -> list[float]:
        rss = []
        for k in range(count):  # three calls to worker threads, as the trainer loop makes
            await asyncio.to_thread(updater.update, batch(k))
            merged = await asyncio.to_thread(policy.export)
            await asyncio.to_thread(probe, merged)
            del merged
            if trim:
                await asyncio.to_thread(release_freed_memory)
            rss.append(round(psutil.Process().memory_info().rss / 1e9, 2))
        return rss

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--variant", choices=("none", "trim"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:  # one variant, in its own process
        print(json.dumps(cycles(args.model, args.cycles, args.variant == "trim")))
        return
    result: dict[str, Any] = {"model": args.model, "cycles": args.cycles, "rss_gb": {}}
    for variant in ("none", "trim"):
        started = time.monotonic()
        cmd = [sys.executable, __file__, "--model", args.model, "--cycles", str(args.cycles)]
        out = subprocess.run(
            [*cmd, "--variant", variant], cwd=ROOT, capture_output=True, text=True, check=True
        )
        result["rss_gb"][variant] = json.loads(out.stdout.strip().splitlines()[-1])
        result[f"{variant}_seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
