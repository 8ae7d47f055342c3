"""Benchmark of the promotion gate: what one probe of a trained version costs the trainer.

The gate answers its probe set with the candidate's weights, judges the replies and scores
them under the reference model, in the trainer's process and between updates, so its
seconds are seconds the demo does not train or serve. This loads the model with LoRA
adapters as the demo trains it (adapters nudged off zero so the candidate differs from the
reference), and times one probe side by side two ways: sampling with the PEFT-wrapped
policy as it stands, and with the plain weights the checkpoint saves (`Policy.export()`,
adapters merged), which is what the trainer probes. Both take the candidate's own log-probs
from `generate`'s logits; the figures also split one probe into sampling, the reference
pass and judging. The export is timed separately: the trainer makes it once per version for
the checkpoint in any case. Prints one JSON object.

    python bench/gate.py [--model smollm2-135m] [--threads 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from liveloop.config import JudgeConfig, SharedSettings
from liveloop.config.gate import GateSettings
from liveloop.config.trainer import LoraSettings
from liveloop.demo.gate_probes import HeldOutUsers
from liveloop.probe_sources import ProbeContext
from liveloop.trainer.policy import Policy, load_policy
from liveloop.trainer.safeguards.gate import PromotionGate, build_panel
from liveloop.trainer.safeguards.probing import judge_replies, reply_logprobs


def nudged_lora_policy(model: str, seed: int) -> Policy:
    """The demo's LoRA policy with small random adapters, as after a few updates."""
    policy = load_policy(model, "cpu", LoraSettings(enabled=True, rank=16, alpha=32))
    set_adapters(policy, seed)
    return policy


def set_adapters(policy: Policy, seed: int, scale: float = 0.002) -> None:
    """Seeded random values (`scale` times normal ones) in the adapters' B matrices: a
    candidate's adapters."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.copy_(scale * torch.randn(param.shape, generator=generator))


def timed(step: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    result = step()
    return time.perf_counter() - started, result


def probe_parts(gate: PromotionGate, policy: Policy, weights: Any) -> dict[str, float]:
    """Seconds of one probe's sampling, reference pass and judging, taken one by one."""
    prompts, seeds = gate._rendered(policy, False)
    sample_s, sampled = timed(lambda: gate._replies(weights, policy.tokenizer, prompts, seeds))
    reference_s, _ = timed(lambda: reply_logprobs(policy.reference_logprobs, sampled, "cpu"))
    judge_s, _ = timed(
        lambda: asyncio.run(judge_replies(gate.panel, gate.probes, sampled, 1, gate.model, seeds))
    )
    return {
        "sample_s": round(sample_s, 2),
        "reference_pass_s": round(reference_s, 2),
        "judge_s": round(judge_s, 2),
        "reply_tokens": sum(len(c) for c in sampled.completions),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the demo's 2)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    policy = nudged_lora_policy(args.model, seed=0)
    shared = SharedSettings(model=args.model)
    cfg = GateSettings(probe_source="demo")
    held_out = HeldOutUsers(ProbeContext(cfg, shared))
    gate = PromotionGate(args.model, cfg, build_panel(JudgeConfig(), shared), held_out)
    gate.probes = asyncio.run(held_out.draw())
    export_s, exported = timed(policy.export)
    ways = {"peft_policy": policy.model, "exported_weights": exported}
    asyncio.run(gate.probe(policy, 1, exported))  # warm-up: prompts rendered, kernels loaded
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, weights in ways.items():
            seconds[name].append(asyncio.run(gate.probe(policy, 1, weights)).seconds)
    report = {
        "model": args.model,
        "threads": args.threads,
        "probes": len(gate.probes),
        "max_tokens": gate.max_tokens,
        "probe_seconds": {k: round(statistics.median(v), 2) for k, v in seconds.items()},
        "export_seconds": round(export_s, 2),
        "exported_probe_parts": probe_parts(gate, policy, exported),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
