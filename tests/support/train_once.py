"""Run the real trainer for one PPO update and print the checkpoint it wrote (test support).

`python -m tests.support.train_once REDIS_URL DATA_DIR MODEL SAMPLES.json` writes the
samples as one batch to `liveloop:batches` on REDIS_URL, runs `liveloop.trainer`'s
`Trainer` until it has applied it, and prints the new version's checkpoint directory (a
full model directory that SGLang loads as it is). A child process, so that the trainer's
memory (the model, its gradients and optimizer state) is given back at once.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import redis.asyncio as aredis

from liveloop.collector.writer import BatchWriter
from liveloop.config import load_settings
from liveloop.contracts import BatchSample
from liveloop.trainer.loop import Trainer


async def train_once(
    redis_url: str, data_dir: Path, model: str, samples: list[BatchSample]
) -> Path:
    """One update on `samples`; the checkpoint directory of the new version."""
    # No promotion gate (its probe replies take minutes on CPU) and no reference model:
    # the update itself is the trainer's ordinary one.
    trainer_cfg = {
        "lr": 1e-4,
        "max_updates": 1,
        "read_block_ms": 100,
        "gate": {"enabled": False},
        "kl_coef": 0.0,
        "measure_drift": False,
    }
    settings = load_settings(
        redis_url=redis_url, data_dir=data_dir, model=model, trainer=trainer_cfg
    )
    client = aredis.from_url(redis_url, decode_responses=True)
    try:
        await BatchWriter(client, data_dir).write(samples, 0)
    finally:
        await client.aclose()
    trainer = Trainer(settings.shared(), settings.trainer, judging=settings.prm)
    await trainer.run()
    return settings.checkpoints_dir.resolve() / f"v{trainer.version}"


def main() -> None:
    """Command-line entry (see the module docstring)."""
    redis_url, data_dir, model, samples_file = sys.argv[1:5]
    raw = json.loads(Path(samples_file).read_text())
    samples = [BatchSample.model_validate(item) for item in raw]
    print(asyncio.run(train_once(redis_url, Path(data_dir), model, samples)))


if __name__ == "__main__":
    main()
