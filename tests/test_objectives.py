"""The objective seam: a training objective from outside the package, named by import path,
validated when the trainer starts, and trained through the real training loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis.asyncio as aredis
import torch

from liveloop.collector.writer import BatchWriter
from liveloop.config import ConfigError, load_settings
from liveloop.config.objective import CombineObjectiveConfig, CustomObjectiveConfig
from liveloop.trainer.data import build_micro_batch
from liveloop.trainer.objectives import BUILTIN, objective_class
from liveloop.trainer.policy import completion_logprobs
from tests.support.toy_objective import Briefer
from tests.test_collector_support import settings_for, trainer_of
from tests.test_trainer import make_samples

TOY = "tests.support.toy_objective:Briefer"


def test_objective_settings_take_a_name_or_a_table(tmp_path: Path) -> None:
    assert isinstance(load_settings(trainer={"objective": "combine"}).trainer.objective,
                      CombineObjectiveConfig)  # fmt: skip
    toml = tmp_path / "toy.toml"
    toml.write_text(
        f'[trainer.objective]\nkind = "custom"\nimport_path = "{TOY}"\noptions = {{ push = 2.0 }}\n'
    )
    objective = load_settings(toml).trainer.objective
    assert isinstance(objective, CustomObjectiveConfig) and objective.options == {"push": 2.0}
    assert objective_class(objective) is Briefer
    assert {name: objective_class(load_settings(trainer={"objective": name}).trainer.objective)
            for name in ("rl", "opd", "combine")} == BUILTIN  # fmt: skip
    with pytest.raises(ConfigError, match=r"trainer\.objective"):
        load_settings(trainer={"objective": "sarsa"})
    with pytest.raises(ConfigError, match="import_path"):
        load_settings(trainer={"objective": {"kind": "custom", "import_path": "no_colon"}})


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("tests.support.no_such_module:Briefer", "cannot import"),
        ("tests.support.toy_objective:Nope", "cannot import"),
        ("tests.support.toy_objective:NotAnObjective", "not a subclass"),
    ],
)
def test_a_bad_custom_objective_stops_the_trainer_at_start_up(
    tmp_path: Path, path: str, message: str
) -> None:
    settings = settings_for(
        "redis://127.0.0.1:1",
        tmp_path,
        trainer={"objective": {"kind": "custom", "import_path": path}},
    )
    with pytest.raises(ConfigError, match=f"trainer.objective.import_path.*{message}"):
        trainer_of(settings)


async def test_a_toy_objective_from_the_test_tree_trains_one_step(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path
) -> None:
    """The loop and the update never name the objective: the toy one drops the short replies
    it rejects, pushes the others' tokens down, and its figures reach the announcement."""
    samples = make_samples(6, seed=3)
    for sample in samples[:2]:  # two one-token replies, which the toy objective rejects
        sample.completion_token_ids = sample.completion_token_ids[:1]
        sample.logprobs, sample.versions = sample.logprobs[:1], sample.versions[:1]
    kept = [s for s in samples if len(s.completion_token_ids) >= 2]
    await BatchWriter(aredis_client, data_dir).write(samples, 0)
    objective = {"kind": "custom", "import_path": TOY, "options": {"push": 1.0, "min_tokens": 2}}
    settings = settings_for(
        redis_url,
        data_dir,
        trainer={"objective": objective, "lr": 1e-2, "max_updates": 1, "read_block_ms": 100,
                 "gate": {"enabled": False}, "watch": {"enabled": False}},
    )  # fmt: skip
    trainer = trainer_of(settings)
    trainer.setup()
    assert trainer.updater is not None and isinstance(trainer.updater.objective, Briefer)
    with torch.no_grad():
        before = completion_logprobs(trainer.updater.policy.model, build_micro_batch(kept))[0]
    await trainer.run()
    assert trainer.version == 1
    assert trainer.metrics.dropped.labels("too_short")._value.get() == 2
    stats = trainer.last_stats
    assert stats is not None and stats.samples == len(kept)
    pushed = sum(len(s.completion_token_ids) for s in kept)
    assert stats.as_metrics()["briefer_tokens"] == pushed
    assert stats.describe().endswith("briefer: pushed down")
    with torch.no_grad():
        after = completion_logprobs(trainer.updater.policy.model, build_micro_batch(kept))[0]
    assert float(after.sum()) < float(before.sum())  # every kept token became less likely


async def test_flat_samples_are_skipped_under_rl_only_when_asked(
    aredis_client: aredis.Redis, redis_url: str, data_dir: Path
) -> None:
    """A task that always scores the same has zero advantage against its own baseline: with
    `skip_flat_samples` the trainer drops those samples (reason `flat`) and trains on the
    rest; a batch of nothing else makes no version. Without it they are trained as before."""
    writer = BatchWriter(aredis_client, data_dir)
    flat_only = make_samples(3, seed=4)
    for sample in flat_only:
        sample.advantage = 0.0
    mixed = make_samples(5, seed=5)
    mixed[0].advantage = mixed[1].advantage = 1e-9
    await writer.write(flat_only, 0)
    await writer.write(mixed, 0)
    trainer_settings = {"lr": 1e-3, "max_updates": 1, "read_block_ms": 100,
                        "gate": {"enabled": False}, "watch": {"enabled": False}}  # fmt: skip
    skipping = trainer_of(
        settings_for(redis_url, data_dir, trainer={**trainer_settings, "skip_flat_samples": True})
    )
    skipping.setup()
    await skipping.run()
    assert skipping.version == 1  # the flat-only batch made no version; the mixed one did
    assert skipping.metrics.dropped.labels("flat")._value.get() == 5
    assert skipping.last_stats is not None and skipping.last_stats.samples == 3
    flat = make_samples(2, seed=6)
    for sample in flat:
        sample.advantage = 0.0
    await writer.write(flat, 1)
    keeping = trainer_of(settings_for(redis_url, data_dir, trainer=trainer_settings))
    keeping.setup()
    await keeping.run()
    assert keeping.last_stats is not None and keeping.last_stats.samples == 2
    assert keeping.metrics.dropped.labels("flat")._value.get() == 0
