"""Benchmark of the gate's reference pass: a packed forward per version against kept prompts.

Every version the gate probes is scored under the reference model (reference NLL, KL). This
times, side by side for the same candidates and replies, the two ways of doing it: one
forward of every probe's prompt and reply packed in a row (how the gate scored a version
before), and `ReferencePrompts`, which runs each prompt through the reference once per probe
set and then only each candidate's reply tokens over the kept keys and values (the first
candidate pays for the prompts, later ones do not). Served probes are conversations: with
`--history K`, each held-out question comes after K earlier exchanges (other held-out
questions, answered by the reference), as a served request carries its session. The LoRA
policy is nudged afresh for each candidate, as updates move it. Prints one JSON object,
with the largest difference between the two ways' log-probs.

    python bench/gate_reference.py [--model smollm2-135m] [--history 2] [--candidates 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from typing import Any

from bench.gate import nudged_lora_policy, set_adapters, timed
from liveloop.config import SharedSettings
from liveloop.config.defaults import model_defaults
from liveloop.config.gate import GateSettings
from liveloop.demo.gate_probes import HeldOutUsers
from liveloop.probe_sources import Probe, ProbeContext
from liveloop.trainer.policy import Policy
from liveloop.trainer.safeguards.gate import reference_weights
from liveloop.trainer.safeguards.prefixes import ReferencePrompts
from liveloop.trainer.safeguards.probing import (
    Sampled,
    probe_seeds,
    render_prompts,
    reply_logprobs,
)
from liveloop.trainer.safeguards.sampling import sample_replies


def conversations(policy: Policy, probes: list[Probe], history: int, tokens: int) -> list[Probe]:
    """Each probe after `history` earlier exchanges: the probes before it (wrapping round),
    answered by the reference model."""
    if history == 0:
        return probes
    prompts = render_prompts(policy.tokenizer, probes)
    with reference_weights(policy) as model:
        answers = _sampled(model, policy, prompts, tokens).texts
    exchanges = [
        [*p.messages, {"role": "assistant", "content": a}]
        for p, a in zip(probes, answers, strict=True)
    ]
    n = len(probes)
    return [
        Probe(
            [m for k in range(history, 0, -1) for m in exchanges[(i - k) % n]] + probe.messages,
            probe.tools,
            probe.topic,
        )
        for i, probe in enumerate(probes)
    ]


def _sampled(model: Any, policy: Policy, prompts: list[list[int]], tokens: int) -> Sampled:
    seeds = probe_seeds(10_000, prompts)
    return sample_replies(
        model, policy.tokenizer, prompts, max_tokens=tokens, temperature=1.0, seeds=seeds
    )


def candidate_seconds(policy: Policy, kept: ReferencePrompts, sampled: Sampled) -> dict[str, Any]:
    """One candidate's replies scored both ways: seconds each, and how far apart."""
    packed_s, packed = timed(lambda: reply_logprobs(policy.reference_logprobs, sampled, "cpu"))
    with reference_weights(policy) as model:
        kept_s, scored = timed(lambda: kept.logprobs(model, sampled.prompts, sampled.completions))
    diff = max(float((a - b).abs().max()) for a, b in zip(packed, scored, strict=True) if len(a))
    return {"packed_s": packed_s, "kept_s": kept_s, "max_abs_diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the demo's 2)")
    parser.add_argument("--history", type=int, default=2, help="earlier exchanges per probe")
    parser.add_argument("--candidates", type=int, default=3)
    parser.add_argument("--probes", type=int, default=24, help="held-out users, one probe each")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    policy = nudged_lora_policy(args.model, seed=0)
    tokens = model_defaults(args.model).reply_tokens
    cfg = GateSettings(probe_source="demo", probe_users=args.probes)
    drawn = asyncio.run(HeldOutUsers(ProbeContext(cfg, SharedSettings(model=args.model))).draw())
    probes = conversations(policy, drawn, args.history, tokens)
    prompts = render_prompts(policy.tokenizer, probes)
    kept = ReferencePrompts(cfg.reference_cache_mib)
    runs = []
    for candidate in range(args.candidates):
        set_adapters(policy, seed=candidate + 1)  # the next candidate's adapters
        sampled = _sampled(policy.model, policy, prompts, tokens)
        runs.append(candidate_seconds(policy, kept, sampled))
    packed = statistics.median(r["packed_s"] for r in runs)
    later = statistics.median(r["kept_s"] for r in runs[1:]) if len(runs) > 1 else None
    report = {
        "model": args.model,
        "threads": args.threads,
        "probes": len(probes),
        "history": args.history,
        "prompt_tokens": sum(len(p) for p in prompts),
        "reply_tokens": sum(len(c) for c in sampled.completions),
        "packed_s": round(packed, 2),
        "kept_first_s": round(runs[0]["kept_s"], 2),
        "kept_later_s": None if later is None else round(later, 2),
        "speedup_later": None if not later else round(packed / later, 1),
        "kept_mib": round(kept.used / 2**20, 1),
        "max_abs_diff": max(r["max_abs_diff"] for r in runs),
        "candidates": [
            {k: round(v, 6 if k == "max_abs_diff" else 2) for k, v in r.items()} for r in runs
        ],
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
