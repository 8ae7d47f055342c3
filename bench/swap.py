"""Benchmark of a live weight swap: the largest gap between two tokens of streams in flight.

Why: the server must take new weights without stalling agents. This runs the embedded
engine on a model with several concurrent streams twice in one process: once undisturbed
(the normal largest inter-token gap) and once while `swap_weights` installs a perturbed
copy of the weights mid-stream (the swap's largest gap). The state dict is prepared before
the run, as the server's follower does off the serving path; what is measured is what an
agent feels. Also checks that no request fails and that tokens after the swap carry the
new version. Prints one JSON object.

    python bench/swap.py --model smollm2-135m --streams 8 --max-tokens 96
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from typing import Any

import torch

from liveloop.models import load_model
from liveloop.server.engine import SamplingParams, TorchEngine


async def stream(
    engine: TorchEngine, prompt: list[int], max_tokens: int
) -> tuple[list[float], list[int]]:
    """Arrival times and versions of one stream's tokens."""
    times: list[float] = []
    versions: list[int] = []
    params = SamplingParams(
        max_tokens=max_tokens, temperature=1.0, seed=len(times), ignore_eos=True
    )
    gen = engine.generate(prompt, params)
    try:
        async for out in gen:
            times.append(time.perf_counter())
            versions.append(out.version)
    finally:
        await gen.aclose()
    return times, versions


def max_gap(times: list[float], after: float = 0.0) -> float:
    """Largest gap between consecutive tokens that arrived after `after`."""
    gaps = [b - a for a, b in itertools.pairwise(times) if a >= after]
    return max(gaps, default=0.0)


async def one_run(
    engine: TorchEngine,
    prompts: list[list[int]],
    args: argparse.Namespace,
    new_weights: dict[str, torch.Tensor] | None,
) -> dict[str, Any]:
    tasks = [asyncio.create_task(stream(engine, p, args.max_tokens)) for p in prompts]
    await asyncio.sleep(0)
    while engine.num_running < len(prompts):  # all streams decoding before anything happens
        await asyncio.sleep(0.01)
    await asyncio.sleep(args.settle_s)
    pause = None
    started = time.perf_counter()
    if new_weights is not None:
        pause = await engine.swap_weights(new_weights, engine.version + 1)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    ok = [r for r in results if not isinstance(r, BaseException)]
    return {
        "max_gap_s": max((max_gap(t, after=started - 1.0) for t, _ in ok), default=0.0),
        "pause_s": pause,
        "failed_requests": len(failed),
        "streams_spanning_swap": sum(len(set(v)) > 1 for _, v in ok),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    engine = TorchEngine(loaded.model, loaded.tokenizer, max_batch_size=args.streams)
    tokenizer: Any = loaded.tokenizer
    prompts = []
    for i in range(args.streams):
        ids: Any = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Tell me a story number {i}."}],
            add_generation_prompt=True,
            tokenize=True,
        )
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    generator = torch.Generator().manual_seed(0)
    new_weights = {
        k: v.detach() + 1e-4 * torch.randn(v.shape, generator=generator)
        for k, v in loaded.model.named_parameters()  # tied weights appear once
    }
    await engine.start()
    try:
        await one_run(engine, prompts, args, None)  # warm-up
        normal = await one_run(engine, prompts, args, None)
        swapped = await one_run(engine, prompts, args, new_weights)
    finally:
        await engine.stop()
    return {
        "model": args.model,
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "normal_max_gap_s": round(normal["max_gap_s"], 4),
        "swap_max_gap_s": round(swapped["max_gap_s"], 4),
        "swap_added_s": round(swapped["max_gap_s"] - normal["max_gap_s"], 4),
        "swap_pause_s": round(swapped["pause_s"] or 0.0, 4),
        "failed_requests": swapped["failed_requests"] + normal["failed_requests"],
        "streams_spanning_swap": swapped["streams_spanning_swap"],
        "target": "swap adds at most 0.1 s to the largest gap; no request fails",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument(
        "--settle-s", type=float, default=1.0, help="decode this long before the swap"
    )
    parser.add_argument("--threads", type=int, default=1)
    result = asyncio.run(main_async(parser.parse_args()))
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
