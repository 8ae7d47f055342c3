"""Benchmark of a tenant-scope cycle's two halves: one after the other, or at the same time.

In tenant scope the trainer trains one tenant's batch, then the promotion gate samples that
tenant's candidate's replies to its probes, then the next tenant's batch is trained. The
next batch is another tenant's adapter, so its training does not need the gate's verdict:
the two could run at the same time. On a small CPU that pays only if the two leave cores
idle when run alone. This measures it for the demo's shapes, in one process as the trainer
would run them (two threads; torch releases the GIL in its kernels): the trainer's LoRA
update (`PPOUpdater.update`, micro-batches of `--micro-batch-tokens`, `--minibatches`
optimizer steps, without the KL anchor's reference forward) on a demo-sized batch of random
tokens, and the gate's sampling of `--probes` held-out questions (one earlier exchange
each) with the candidate's merged weights, as the gate samples. Prints one JSON object:
each half alone, both at once, and the speed-up of a pipelined cycle.

    python bench/gate_overlap.py [--model smollm2-135m] [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# `python bench/gate_overlap.py` puts bench/ first on sys.path; the repository root goes there
# instead, for the `bench.*` imports.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.gate import nudged_lora_policy
from bench.gate_reference import conversations
from bench.trainer import random_sample, timed
from liveloop.config import SharedSettings
from liveloop.config.defaults import model_defaults
from liveloop.config.gate import GateSettings
from liveloop.config.trainer import LoraSettings, TrainerConfig
from liveloop.contracts import BatchSample
from liveloop.demo.gate_probes import HeldOutUsers
from liveloop.probe_sources import ProbeContext
from liveloop.trainer.policy import load_policy
from liveloop.trainer.ppo import PPOUpdater
from liveloop.trainer.safeguards.probing import probe_seeds, render_prompts
from liveloop.trainer.safeguards.sampling import sample_replies


def demo_batch(n: int, vocab: int, seed: int) -> list[BatchSample]:
    """Samples shaped like a tenants-demo batch: prompts of 60-220 tokens (a question after
    earlier exchanges), replies of 15-48 tokens, advantages of either sign."""
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        lengths = rng.randint(60, 220), rng.randint(15, 48)
        samples.append(random_sample(rng, f"t{i}", lengths, vocab, -2.5))
    return samples


def both_at_once(first: Callable[[], object], second: Callable[[], object]) -> dict[str, float]:
    """Run the two in two threads from the same instant: each one's seconds, and the wall
    time until both have finished."""
    seconds: dict[str, float] = {}
    start = threading.Barrier(3)

    def run(name: str, step: Callable[[], object]) -> None:
        start.wait()
        began = time.perf_counter()
        step()
        seconds[name] = time.perf_counter() - began

    threads = [
        threading.Thread(target=run, args=("train", first)),
        threading.Thread(target=run, args=("probe", second)),
    ]
    for t in threads:
        t.start()
    began = time.perf_counter()
    start.wait()
    for t in threads:
        t.join()
    seconds["both"] = time.perf_counter() - began
    return seconds


def halves(args: argparse.Namespace) -> tuple[Callable[[], Any], Callable[[], Any], dict[str, int]]:
    """The two halves of a cycle, each a call: one tenant's update and the gate's sampling of
    another tenant's candidate (two policies, as two adapters are), and their sizes."""
    lora = LoraSettings(enabled=True, rank=16, alpha=32)
    cfg = TrainerConfig(
        lora=lora, kl_coef=0.0, micro_batch_tokens=args.micro_batch_tokens,
        minibatches=args.minibatches,
    )  # fmt: skip
    trained = load_policy(args.model, "cpu", lora)
    updater = PPOUpdater(trained, cfg)
    samples = demo_batch(args.samples, len(trained.tokenizer), seed=0)

    candidate = nudged_lora_policy(args.model, seed=1)
    tokens = model_defaults(args.model).reply_tokens
    gate = GateSettings(probe_source="demo", probe_users=args.probes)
    drawn = asyncio.run(HeldOutUsers(ProbeContext(gate, SharedSettings(model=args.model))).draw())
    prompts = render_prompts(candidate.tokenizer, conversations(candidate, drawn, 1, tokens))
    seeds = probe_seeds(0, prompts)
    merged = candidate.export()

    def train() -> Any:
        return updater.update(samples)

    def probe() -> Any:
        return sample_replies(
            merged, candidate.tokenizer, prompts, max_tokens=tokens, temperature=1.0, seeds=seeds
        )

    sizes = {
        "batch_samples": len(samples),
        "batch_tokens": sum(s.num_tokens for s in samples),
        "probes": len(prompts),
        "probe_prompt_tokens": sum(len(p) for p in prompts),
        "reply_tokens": tokens,
    }
    return train, probe, sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the demo's 2)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=20, help="turns in the trained batch")
    parser.add_argument("--probes", type=int, default=24, help="the gate's probes")
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--minibatches", type=int, default=3, help="optimizer steps a batch")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    train, probe, sizes = halves(args)
    train(), probe()  # warm-up
    train_s, probe_s = (timed(step, 0, args.repeats, "cpu") for step in (train, probe))
    runs = [both_at_once(train, probe) for _ in range(args.repeats)]
    both_s = statistics.median(r["both"] for r in runs)
    report = {
        "benchmark": "gate_overlap",
        "model": args.model,
        "threads": args.threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        **sizes,
        "minibatches": args.minibatches,
        "train_alone_s": round(train_s, 2),
        "probe_alone_s": round(probe_s, 2),
        "one_after_the_other_s": round(train_s + probe_s, 2),
        "at_once_s": round(both_s, 2),
        "at_once_train_s": round(statistics.median(r["train"] for r in runs), 2),
        "at_once_probe_s": round(statistics.median(r["probe"] for r in runs), 2),
        "speedup": round((train_s + probe_s) / both_s, 2),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
