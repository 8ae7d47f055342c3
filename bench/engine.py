"""Benchmark of the embedded torch engine: continuous batching vs one request at a time.

Why: the engine exists to serve many agents at once on modest hardware; this measures the
generated tokens per second at 1, 4 and 16 concurrent requests, with the same engine
batching (max_batch_size=16) or serving one request at a time (max_batch_size=1, the
others wait FIFO). Prompts are fixed chat prompts of varied length and `ignore_eos` fixes
the completion lengths, so both modes do the same work; the prefix cache is emptied before
each run, so only the chat template's shared system prompt is reused within a run. Prints
one JSON object to stdout; progress goes to stderr. Wall time includes prefill.

On a machine shared with other processes wall-clock rates swing widely; with `--threads 1`
all compute runs in the decode thread, so `tok_per_decode_thread_cpu_s` (tokens per CPU
second of that thread) is a contention-robust view of the same comparison.

    python bench/engine.py --models tiny-random smollm2-135m --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from liveloop.models import LoadedModel, load_model
from liveloop.server.engine import SamplingParams, TorchEngine

TOPICS = (
    "the water cycle",
    "how a CPU cache works",
    "why the sky is blue",
    "the rules of chess",
    "how vaccines train the immune system",
    "what a hash table is",
    "the history of the printing press",
    "how to brew good coffee",
)
FILLER = (
    "Please be precise, use short sentences, give one concrete example, and mention a "
    "common misconception. "
)


def bench_prompts(loaded: LoadedModel, count: int) -> list[list[int]]:
    """`count` fixed chat prompts whose lengths vary from ~30 to ~150 tokens."""
    prompts = []
    for i in range(count):
        text = f"Explain {TOPICS[i % len(TOPICS)]}. " + FILLER * (i % 5)
        ids: Any = loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if not isinstance(ids, list):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        prompts.append([int(t) for t in ids])
    return prompts


@dataclass
class Run:
    """One measurement: end-to-end rate plus where the decode thread spent its time."""

    tok_s: float
    decode_tok_s: float
    prefill_s: float
    decode_s: float
    tok_per_cpu_s: float


async def run_batch(engine: TorchEngine, prompts: list[list[int]], max_tokens: int) -> Run:
    """Submit all `prompts` at once; generated tokens per second over the wall time."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(prompt: list[int]) -> int:
        return sum([1 async for _ in engine.generate(prompt, params)])

    engine.clear_prefix_cache()  # only prefixes shared within the run may be reused
    before = engine.stats
    started = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - started
    after = engine.stats
    decode_s = after.decode_seconds - before.decode_seconds
    return Run(
        tok_s=sum(counts) / wall,
        decode_tok_s=(after.decode_tokens - before.decode_tokens) / max(decode_s, 1e-9),
        prefill_s=after.prefill_seconds - before.prefill_seconds,
        decode_s=decode_s,
        tok_per_cpu_s=sum(counts) / max(after.busy_cpu_seconds - before.busy_cpu_seconds, 1e-9),
    )


def summarize(runs: dict[str, dict[str, list[Run]]]) -> dict[str, Any]:
    """Best run per mode and level, the speed-up of batching, and every run's numbers."""
    best = {
        m: {lvl: max(r, key=lambda x: x.tok_s) for lvl, r in v.items()} for m, v in runs.items()
    }
    out: dict[str, Any] = {
        m: {lvl: round(b.tok_s, 2) for lvl, b in v.items()} for m, v in best.items()
    }
    out["speedup"] = {
        lvl: round(best["batched"][lvl].tok_s / best["one_at_a_time"][lvl].tok_s, 2)
        for lvl in best["batched"]
    }
    out["decode_only_tok_s"] = {
        m: {lvl: round(b.decode_tok_s, 2) for lvl, b in v.items()} for m, v in best.items()
    }
    out["tok_per_decode_thread_cpu_s"] = {
        m: {lvl: round(max(x.tok_per_cpu_s for x in r), 2) for lvl, r in v.items()}
        for m, v in runs.items()
    }
    out["prefill_share_of_busy_time"] = {
        m: {
            lvl: round(b.prefill_s / max(b.prefill_s + b.decode_s, 1e-9), 2) for lvl, b in v.items()
        }
        for m, v in best.items()
    }
    out["all_runs_tok_s"] = {
        m: {lvl: [round(x.tok_s, 1) for x in r] for lvl, r in v.items()} for m, v in runs.items()
    }
    return out


async def bench_model(
    name: str, levels: list[int], max_tokens: int, repeats: int
) -> dict[str, Any]:
    """Best-of-`repeats` tokens/s per concurrency level for both modes of one model."""
    loaded = load_model(name)
    prompts = bench_prompts(loaded, max(levels))
    engines = {
        "batched": TorchEngine(loaded.model, loaded.tokenizer, max_batch_size=max(levels)),
        "one_at_a_time": TorchEngine(loaded.model, loaded.tokenizer, max_batch_size=1),
    }
    runs: dict[str, dict[str, list[Run]]] = {m: {str(lvl): [] for lvl in levels} for m in engines}
    for engine in engines.values():
        await engine.start()
        await run_batch(engine, prompts[:1], 4)  # warm-up
    # Modes alternate within each repeat so that load from other processes hits both alike.
    for _ in range(repeats):
        for level in levels:
            for mode, engine in engines.items():
                run = await run_batch(engine, prompts[:level], max_tokens)
                runs[mode][str(level)].append(run)
                print(f"{name} {mode} x{level}: {run}", file=sys.stderr)
    pause = await swap_pause(engines["batched"], prompts[:4], loaded)
    for engine in engines.values():
        await engine.stop()
    lengths = [len(p) for p in prompts]
    return {
        **summarize(runs),
        "prompt_tokens": {"min": min(lengths), "max": max(lengths)},
        "swap_pause_s": round(pause, 4),
    }


async def swap_pause(engine: TorchEngine, prompts: list[list[int]], loaded: LoadedModel) -> float:
    """Decode-loop pause of a weight swap (the same weights, copied) under 4 live requests."""
    state_dict = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    task = asyncio.ensure_future(run_batch(engine, prompts, 32))
    while engine.num_running < len(prompts):
        await asyncio.sleep(0.01)
    pause = await engine.swap_weights(state_dict, version=engine.version + 1)
    await task
    return pause


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    levels = [int(x) for x in args.concurrency.split(",")]
    out: dict[str, Any] = {
        "unit": "generated tokens/s over wall time incl. prefill (best of repeats); decode_only_tok_s excludes prefill",
        "max_tokens": args.max_tokens,
        "torch_threads": torch.get_num_threads(),
        "models": {},
    }
    for name in args.models:
        out["models"][name] = await bench_model(name, levels, args.max_tokens, args.repeats)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--models", nargs="+", default=["tiny-random", "smollm2-135m"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's own); 1 is fastest on a shared small VM",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
