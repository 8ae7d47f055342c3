"""Trainer throughput vs a bare forward+backward loop of the same model on the same batch.

Prints one JSON object. The trainer side is `PPOUpdater.update` with the default trainer
settings: decoupled PPO loss, importance weights, entropy and KL statistics, gradient
clipping and an AdamW step, sequences packed without padding into micro-batches of
`micro_batch_tokens`, and vocabulary logits only where a completion token is predicted.

The bare side is what a minimal training loop does with the same samples: a causal-LM loss
(`labels`, prompt positions set to -100) forward, backward and an AdamW step, nothing else.
Three bare variants run, and the trainer is compared with the fastest:
- `bare_padded`: length-sorted, right-padded micro-batches of at most `micro_batch_tokens`
  padded tokens (the usual loop);
- `bare_packed`: the very same packed rows as the trainer, logits at every position;
- `bare_sliced`: the same packed rows with logits only at completion positions and a plain
  cross-entropy on them, i.e. the trainer's data path without anything PPO adds (the
  proximal and importance-weight arithmetic, entropy and KL statistics, gradient clipping).

The trainer also runs a second time with its KL anchor on (`trainer_anchored`: the frozen
reference model, one extra no-grad forward per micro-batch for its log-probs, the penalty
in the loss, and the per-version drift sums), so the anchor's cost shows side by side.

Tokens per second counts real tokens (prompt + completion) for every variant. Each
variant runs `--warmup` untimed and `--iters` timed iterations on its own fresh copy of
the model; the median iteration time is reported.

On a GPU (`--device cuda`) every variant runs there, the timings wait for the device
(`torch.cuda.synchronize`), and each variant's peak GPU memory is reported beside it.

    python bench/trainer.py [--model tiny-random] [--samples 16] [--iters 5] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# `python bench/trainer.py` puts bench/ first on sys.path, where this file would shadow the
# `trainer` package: the repository root goes there instead.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch

from liveloop.config.defaults import model_defaults
from liveloop.config.trainer import TrainerConfig
from liveloop.contracts import BatchSample
from liveloop.models import load_model, load_tokenizer
from liveloop.trainer.data import MicroBatch, micro_batches
from liveloop.trainer.policy import load_policy
from liveloop.trainer.ppo import PPOUpdater


def random_sample(
    rng: random.Random, key: str, lengths: tuple[int, int], vocab: int, logprob: float
) -> BatchSample:
    """A sample of random tokens: `lengths` = (prompt, completion) tokens, an advantage of
    either sign, every completion token's behaviour log-prob `logprob`."""
    prompt, completion = lengths
    return BatchSample(
        key=key,
        prompt_token_ids=[rng.randrange(3, vocab) for _ in range(prompt)],
        completion_token_ids=[rng.randrange(3, vocab) for _ in range(completion)],
        logprobs=[logprob] * completion,
        versions=[0] * completion,
        advantage=rng.uniform(-1, 1),
        score=0.0,
    )


def make_batch(n: int, vocab: int, seed: int) -> list[BatchSample]:
    """Agent-like samples: prompts of 64-512 tokens, long-tailed completions of 8-512."""
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        prompt = rng.randint(64, 512)
        completion = min(512, max(8, int(rng.lognormvariate(4.0, 0.8))))
        samples.append(random_sample(rng, f"b{i}", (prompt, completion), vocab, -10.8))
    return samples


def padded_micro_batches(
    samples: list[BatchSample], max_tokens: int, pad_id: int
) -> list[dict[str, torch.Tensor]]:
    """Length-sorted, right-padded micro-batches with causal-LM labels on completions."""
    ordered = sorted(samples, key=lambda s: s.num_tokens, reverse=True)
    groups: list[list[BatchSample]] = []
    for s in ordered:
        if groups and groups[-1][0].num_tokens * (len(groups[-1]) + 1) <= max_tokens:
            groups[-1].append(s)
        else:
            groups.append([s])
    batches = []
    for group in groups:
        width = group[0].num_tokens
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        labels = torch.full((len(group), width), -100, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for row, s in enumerate(group):
            seq = s.prompt_token_ids + s.completion_token_ids
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
            labels[row, len(s.prompt_token_ids) : len(seq)] = torch.tensor(s.completion_token_ids)
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return batches


def packed_lm_batches(mbs: list[MicroBatch]) -> list[dict[str, torch.Tensor]]:
    """The trainer's packed rows, as causal-LM inputs with labels on completion tokens."""
    batches = []
    for mb in mbs:
        labels = torch.full_like(mb.input_ids, -100)
        labels[0, mb.logit_index + 1] = mb.targets
        batches.append(
            {"input_ids": mb.input_ids, "position_ids": mb.position_ids, "labels": labels}
        )
    return batches


def bare_step(
    model_spec: str, batches: list[dict[str, torch.Tensor]], lr: float, device: str
) -> Callable[[], None]:
    """One bare iteration: forward with labels, backward, AdamW step."""
    model = load_model(model_spec, device=device).model
    batches = [{k: v.to(device) for k, v in b.items()} for b in batches]
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    label_tokens = sum(int((b["labels"] != -100).sum()) for b in batches)

    def step() -> None:
        for b in batches:
            out = model(**b, use_cache=False)
            n = int((b["labels"] != -100).sum())
            (out.loss * n / label_tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def sliced_step(
    model_spec: str, mbs: list[MicroBatch], lr: float, device: str
) -> Callable[[], None]:
    """Bare iteration on the trainer's packed rows, logits only where completions are predicted."""
    model = load_model(model_spec, device=device).model
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    total = sum(mb.num_targets for mb in mbs)

    def step() -> None:
        for mb in mbs:
            out = model(
                input_ids=mb.input_ids,
                position_ids=mb.position_ids,
                logits_to_keep=mb.logit_index,
                use_cache=False,
            )
            loss = torch.nn.functional.cross_entropy(out.logits[0], mb.targets, reduction="sum")
            (loss / total).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def timed(step: Callable[[], object], warmup: int, iters: int, device: str) -> float:
    """Median seconds of one call (on a GPU, until the device has finished it)."""
    cuda = device.startswith("cuda")

    def run() -> None:
        step()
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        run()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_gib(device: str) -> float | None:
    """Peak GPU memory allocated since the last `timed` began (None on the CPU)."""
    if not device.startswith("cuda"):
        return None
    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    device = args.device
    peaks: dict[str, float | None] = {}

    def measure(name: str, step: Callable[[], object]) -> float:
        seconds = timed(step, args.warmup, args.iters, device)
        peaks[name] = peak_gib(device)
        return seconds

    def time_update(name: str, cfg: TrainerConfig, with_reference: bool) -> float:
        """The trainer's update on its own policy, freed (GPU memory too) on return."""
        policy = load_policy(args.model, device, cfg.lora, with_reference=with_reference)
        updater = PPOUpdater(policy, cfg)
        return measure(name, lambda: updater.update(samples))

    tokenizer = load_tokenizer(args.model)
    samples = make_batch(args.samples, len(tokenizer), args.seed)
    tokens = sum(s.num_tokens for s in samples)
    pad_id = tokenizer.pad_token_id or 0
    cfg = TrainerConfig(kl_coef=0.0, device=device)
    trainer_s = time_update("trainer", cfg, with_reference=False)
    kl_coef = model_defaults(args.model).kl_coef
    anchored_cfg = TrainerConfig(kl_coef=kl_coef, device=device)
    anchored_s = time_update("trainer_anchored", anchored_cfg, with_reference=True)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()

    padded = padded_micro_batches(samples, cfg.micro_batch_tokens, pad_id)
    mbs = micro_batches(samples, cfg.micro_batch_tokens, device)
    packed = packed_lm_batches(mbs)
    lr = cfg.lr
    bare_padded_s = measure("bare_padded", bare_step(args.model, padded, lr, device))
    bare_packed_s = measure("bare_packed", bare_step(args.model, packed, lr, device))
    bare_sliced_s = measure("bare_sliced", sliced_step(args.model, mbs, lr, device))

    best_bare = min(bare_padded_s, bare_packed_s, bare_sliced_s)
    result = {
        "benchmark": "trainer",
        "model": args.model,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "samples": len(samples),
        "tokens": tokens,
        "completion_tokens": sum(len(s.completion_token_ids) for s in samples),
        "micro_batch_tokens": cfg.micro_batch_tokens,
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "trainer_tokens_per_s": round(tokens / trainer_s, 1),
        "trainer_anchored_tokens_per_s": round(tokens / anchored_s, 1),
        "anchor_kl_coef": kl_coef,
        "anchor_time_ratio": round(anchored_s / trainer_s, 3),
        "bare_padded_tokens_per_s": round(tokens / bare_padded_s, 1),
        "bare_packed_tokens_per_s": round(tokens / bare_packed_s, 1),
        "bare_sliced_tokens_per_s": round(tokens / bare_sliced_s, 1),
        "ratio_vs_best_bare": round(best_bare / trainer_s, 3),
        "target_ratio": 0.8,
    }
    if device.startswith("cuda"):
        result["peak_gpu_gib"] = peaks
    result["meets_target"] = result["ratio_vs_best_bare"] >= 0.8
    print(json.dumps(result))


if __name__ == "__main__":
    main()
