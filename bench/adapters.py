"""Benchmark of many LoRA adapters in one torch engine batch, against the base alone.

Why: adapters are served side by side (each row of a decode step applies its own), so
their cost is what batching them adds over decoding the base model. This runs the same
16 streams (fixed chat prompts, `ignore_eos`, same completion lengths) four ways: all on
the base, all on one adapter, over 4 distinct adapters, and over 16 distinct adapters.
The adapters are PEFT LoRA adapters (rank `--rank` on all seven linears of every layer,
random non-zero weights) written to a temporary directory and loaded into the engine;
all fit in memory (no reloads). Modes alternate within each round so that load from
other processes hits them alike; the figures are medians over rounds, and each mode's
ratio to the base is the median of the per-round ratios. Prints one JSON object to
stdout; progress goes to stderr.

    python bench/adapters.py --model smollm2-135m --max-tokens 64 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.engine import bench_prompts
from liveloop.models import LoadedModel, load_model
from liveloop.server.engine import SamplingParams, TorchEngine

STREAMS = 16
MODES = {"base": 0, "1_adapter": 1, "4_adapters": 4, "16_adapters": 16}


def write_adapters(loaded: LoadedModel, root: Path, count: int, rank: int) -> list[Path]:
    """`count` PEFT adapters of the model with seeded random A and B."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0)
    model = get_peft_model(copy.deepcopy(loaded.model), config)
    paths = []
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for i in range(count):
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
            path = root / f"adapter-{i}"
            model.save_pretrained(str(path))
            paths.append(path)
    return paths


async def run_mode(
    engine: TorchEngine, prompts: list[list[int]], adapters: int, max_tokens: int
) -> dict[str, float]:
    """All streams at once; stream i on adapter `i % adapters` (none when 0)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> int:
        adapter = f"a{i % adapters}" if adapters else None
        return sum([1 async for _ in engine.generate(prompt, params, adapter=adapter)])

    engine.clear_prefix_cache()
    before = engine.stats
    started = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - started
    after = engine.stats
    decode_s = after.decode_seconds - before.decode_seconds
    busy = after.busy_cpu_seconds - before.busy_cpu_seconds
    return {
        "tok_s": sum(counts) / wall,
        "decode_tok_s": (after.decode_tokens - before.decode_tokens) / max(decode_s, 1e-9),
        "tok_per_cpu_s": sum(counts) / max(busy, 1e-9),
    }


def summarize(rounds: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Medians per mode and metric, and each mode's median per-round ratio to the base."""
    out: dict[str, Any] = {}
    for metric in ("tok_s", "decode_tok_s", "tok_per_cpu_s"):
        out[metric] = {
            mode: round(statistics.median(r[mode][metric] for r in rounds), 2) for mode in MODES
        }
        out[f"{metric}_vs_base"] = {
            mode: round(statistics.median(r[mode][metric] / r["base"][metric] for r in rounds), 3)
            for mode in MODES
            if mode != "base"
        }
    out["all_rounds_tok_s"] = {mode: [round(r[mode]["tok_s"], 1) for r in rounds] for mode in MODES}
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    loaded = load_model(args.model)
    prompts = bench_prompts(loaded, STREAMS)
    engine = TorchEngine(
        loaded.model, loaded.tokenizer, max_batch_size=STREAMS, max_loaded_adapters=STREAMS
    )
    await engine.start()
    with tempfile.TemporaryDirectory() as tmp:
        for i, path in enumerate(write_adapters(loaded, Path(tmp), STREAMS, args.rank)):
            await engine.load_adapter(f"a{i}", 1, str(path))
    await run_mode(engine, prompts[:2], 2, 4)  # warm-up
    rounds = []
    for index in range(args.rounds):
        order = list(MODES)
        order = order[index % len(order) :] + order[: index % len(order)]
        results = {}
        for mode in order:
            results[mode] = await run_mode(engine, prompts, MODES[mode], args.max_tokens)
            print(f"round {index} {mode}: {results[mode]}", file=sys.stderr)
        rounds.append(results)
    await engine.stop()
    return {
        "unit": "generated tokens/s of 16 streams over wall time incl. prefill (median of rounds)",
        "model": args.model,
        "streams": STREAMS,
        "rank": args.rank,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "torch_threads": torch.get_num_threads(),
        **summarize(rounds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
