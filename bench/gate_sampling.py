"""Benchmark of the gate's sampling: one left-padded `generate` against unpadded prefill.

The gate samples a reply per probe from every candidate it probes. Served probes are
conversations of different lengths that share a start (the chat template's system message,
the tools' schemas). This samples the same probes with the same seeds side by side two
ways: `padded`, one `generate` over the prompts left-padded to the longest (how the gate
sampled before), and `unpadded` (`sample_replies`: the shared start run once, the rest of
each prompt in groups of similar length, then one batched decode). Probe i follows i mod 3
earlier exchanges, as a session's first, second and third requests; with `--tools` every
probe offers the demo's weather tool, as a tool-using tenant's requests do. Prints one JSON
object: the prompt tokens each way, seconds each way, and whether the replies are the same.

    python -m bench.gate_sampling [--model smollm2-135m] [--tools] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from dataclasses import replace
from typing import Any

from bench.gate import nudged_lora_policy, timed
from bench.gate_reference import conversations
from liveloop.config import SharedSettings
from liveloop.config.defaults import model_defaults
from liveloop.config.gate import GateSettings
from liveloop.demo.gate_probes import HeldOutUsers
from liveloop.demo.users import WEATHER_TOOL
from liveloop.probe_sources import Probe, ProbeContext
from liveloop.trainer.policy import Policy
from liveloop.trainer.safeguards import sampling
from liveloop.trainer.safeguards.probing import probe_seeds, render_prompts


def session_probes(policy: Policy, args: argparse.Namespace, tokens: int) -> list[Probe]:
    """Held-out questions, probe i after i mod 3 earlier exchanges (with the weather tool
    offered when asked)."""
    cfg = GateSettings(probe_source="demo", probe_users=args.probes)
    drawn = asyncio.run(HeldOutUsers(ProbeContext(cfg, SharedSettings(model=args.model))).draw())
    if args.tools:
        drawn = [replace(p, tools=[WEATHER_TOOL]) for p in drawn]
    by_history = [conversations(policy, drawn, history, tokens) for history in range(3)]
    return [by_history[i % 3][i] for i in range(len(drawn))]


def both_ways(model: Any, tokenizer: Any, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """One sampling each way, timed, and how far apart their replies and log-probs are."""
    seeds = probe_seeds(10_000, prompts)
    eos_ids = sampling.end_ids(model, tokenizer)
    sampler = sampling.RowSampler(seeds, 1.0)
    padded_s, (padded, logprobs) = timed(
        lambda: sampling.generate_padded(model, tokenizer, prompts, sampler, tokens, eos_ids)
    )
    unpadded_s, sampled = timed(
        lambda: sampling.sample_replies(
            model, tokenizer, prompts, max_tokens=tokens, temperature=1.0, seeds=seeds
        )
    )
    same = [c == padded[i, : len(c)].tolist() for i, c in enumerate(sampled.completions)]
    diffs = [
        float((logprobs[i, : len(c)] - sampled.logprobs[i]).abs().max())
        for i, c in enumerate(sampled.completions)
        if same[i] and c
    ]
    return {"padded_s": padded_s, "unpadded_s": unpadded_s, "same_replies": sum(same),
            "max_abs_diff": max(diffs, default=0.0)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the demo's 2)")
    parser.add_argument("--probes", type=int, default=24, help="held-out users, one probe each")
    parser.add_argument("--tools", action="store_true", help="offer the weather tool")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    policy = nudged_lora_policy(args.model, seed=1)
    tokens = model_defaults(args.model).reply_tokens
    prompts = render_prompts(policy.tokenizer, session_probes(policy, args, tokens))
    model = policy.export()  # the gate samples the candidate's merged weights
    model.eval()
    with torch.no_grad():
        both_ways(model, policy.tokenizer, prompts[:4], 4)  # warm-up
        runs = [both_ways(model, policy.tokenizer, prompts, tokens) for _ in range(args.repeats)]
    start = sampling.shared_start(prompts)
    padded_s = statistics.median(r["padded_s"] for r in runs)
    unpadded_s = statistics.median(r["unpadded_s"] for r in runs)
    report = {
        "benchmark": "gate_sampling",
        "model": args.model,
        "threads": args.threads,
        "probes": len(prompts),
        "tools": args.tools,
        "reply_tokens": tokens,
        "prompt_tokens": sum(len(p) for p in prompts),
        "padded_prompt_tokens": len(prompts) * max(len(p) for p in prompts),
        "shared_start_tokens": start,
        "length_groups": len(sampling.length_groups([len(p) - 1 - start for p in prompts])),
        "padded_s": round(padded_s, 2),
        "unpadded_s": round(unpadded_s, 2),
        "speedup": round(padded_s / unpadded_s, 2),
        "same_replies": min(r["same_replies"] for r in runs),
        "max_abs_diff": max(r["max_abs_diff"] for r in runs),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
