"""Benchmark of shared prefixes: one update on multi-turn traffic, shared rows vs a row each.

An agent's session is a chain of turns, and the server extends a session's prompt
token-exactly, so turn k's prompt and reply are the first tokens of turn k+1's prompt. When
both are in one batch, the trainer scores turn k inside turn k+1's forward pass
(`trainer.share_prefixes`, on by default) instead of running its tokens a second time. This
builds a batch shaped like the demo's (sessions of one to five turns, 35-token first
prompts, 20-48-token replies, short user follow-ups; one to three consecutive turns of each
session in the batch, as the collector gathers them when they are judged) and times
`PPOUpdater.update` on it side by side: prefixes shared, and each sample in a row of its
own. Both run the demo's trainer set-up (LoRA rank 16, the KL anchor's reference pass,
micro-batches of 1024 tokens) on fresh copies of the model. Prints one JSON object.

    python bench/prefixes.py [--model smollm2-135m] [--sessions 10] [--iters 3]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

# `python bench/prefixes.py` puts bench/ first on sys.path, where bench/trainer.py would
# shadow the `trainer` package: the repository root goes there instead.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.trainer import timed
from liveloop.config.defaults import model_defaults
from liveloop.config.trainer import LoraSettings, TrainerConfig
from liveloop.contracts import BatchSample
from liveloop.models import load_tokenizer
from liveloop.trainer.data import share_prefixes
from liveloop.trainer.policy import load_policy
from liveloop.trainer.ppo import PPOUpdater


def session_batch(sessions: int, vocab: int, seed: int) -> list[BatchSample]:
    """One to three consecutive turns of each of `sessions` sessions of one to five turns."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    batch: list[BatchSample] = []
    for s in range(sessions):
        last = rng.randint(0, 4)
        first = max(0, last - rng.randint(0, 2))
        prompt = tokens(rng.randint(33, 37))
        for turn in range(last + 1):
            reply = tokens(rng.randint(20, 48))
            if turn >= first:
                batch.append(
                    BatchSample(
                        key=f"s{s}:{turn}",
                        prompt_token_ids=prompt,
                        completion_token_ids=reply,
                        logprobs=[-2.0] * len(reply),
                        versions=[0] * len(reply),
                        advantage=rng.uniform(-1, 1),
                        score=0.0,
                    )
                )
            prompt = prompt + reply + tokens(rng.randint(15, 30))  # the user's next message
    return batch


def update_seconds(
    model: str, samples: list[BatchSample], share: bool, args: argparse.Namespace
) -> float:
    """Median seconds of one update of a fresh LoRA policy with its reference pass."""
    cfg = TrainerConfig(
        lr=1e-3,
        kl_coef=model_defaults(model).kl_coef,
        micro_batch_tokens=1024,
        share_prefixes=share,
        lora=LoraSettings(enabled=True, rank=16, alpha=32),
    )
    policy = load_policy(model, "cpu", cfg.lora, with_reference=True)
    updater = PPOUpdater(policy, cfg)
    return timed(lambda: updater.update(samples), args.warmup, args.iters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--sessions", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    vocab = len(load_tokenizer(args.model))
    samples = session_batch(args.sessions, vocab, args.seed)
    rows = share_prefixes(samples)
    tokens = sum(s.num_tokens for s in samples)
    row_tokens = sum(r.num_tokens for r in rows)
    alone_s = update_seconds(args.model, samples, False, args)
    shared_s = update_seconds(args.model, samples, True, args)
    print(
        json.dumps(
            {
                "benchmark": "prefixes",
                "model": args.model,
                "threads": args.threads,
                "samples": len(samples),
                "rows_shared": len(rows),
                "tokens": tokens,
                "tokens_run_shared": row_tokens,
                "tokens_saved_pct": round(100 * (1 - row_tokens / tokens), 1),
                "update_seconds": {"row_each": round(alone_s, 2), "shared": round(shared_s, 2)},
                "speedup": round(alone_s / shared_s, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
