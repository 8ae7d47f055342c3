"""The weight transport on tiny-random and a real Valkey: write, announce, follow, validate, load."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import redis.asyncio as aredis
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from liveloop.contracts import WeightsAnnouncement
from liveloop.models import load_model
from liveloop.weights import (
    CheckpointError,
    SharedDiskTransport,
    check_checkpoint,
    latest_announcement,
    setup_weight_transport,
)


def test_written_version_is_a_full_hugging_face_model_directory(tmp_path: Path) -> None:
    tiny = load_model("tiny-random")
    transport = SharedDiskTransport(tmp_path / "checkpoints")
    extra_seen: list[Path] = []

    def extra(directory: Path) -> None:
        assert not directory.name.startswith("v")  # not visible under its final name yet
        (directory / "trainer_state").mkdir()
        extra_seen.append(directory)

    location = transport.write(3, tiny.model, tiny.tokenizer, extra)
    assert location == str((tmp_path / "checkpoints" / "v3").resolve())
    assert extra_seen and (Path(location) / "trainer_state").is_dir()
    assert transport.version_dirs() == {3: tmp_path / "checkpoints" / "v3"}
    # What another engine would do with it: load model and tokenizer as they are.
    model = AutoModelForCausalLM.from_pretrained(location, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(location)
    assert tokenizer.encode("hello") == tiny.tokenizer.encode("hello")
    state = transport.load(location)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items() if k in state)
    transport.validate(location)
    # A second write reuses the serialised tokenizer and leaves no scratch behind.
    transport.write(4, tiny.model, tiny.tokenizer)
    transport.clean_scratch()
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == [f".tokenizer-{os.getpid()}", "v3", "v4"]


def test_validate_reads_headers_only_and_names_the_problem(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not found"):
        check_checkpoint(tmp_path / "nowhere")
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(CheckpointError, match="unreadable safetensors"):
        check_checkpoint(tmp_path / "garbage")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="LoRA adapter"):
        check_checkpoint(tmp_path / "adapter")


async def test_announce_once_latest_and_updates(
    aredis_client: aredis.Redis, tmp_path: Path
) -> None:
    transport = setup_weight_transport(tmp_path, aredis_client)
    assert await transport.latest() is None
    cursor, recent = await transport.updates(None, block_ms=10)
    assert (cursor, recent) == ("0-0", [])
    first = WeightsAnnouncement(version=1, path=str(tmp_path / "v1"))
    assert await transport.announce(first) is True
    assert await transport.announce(first) is False  # same version and path: once
    await aredis_client.xadd("liveloop:weights", {"data": "{not json"})  # skipped by readers
    cursor, found = await transport.updates(cursor, block_ms=10)
    assert [a.version for a in found] == [1]
    assert await transport.announce(WeightsAnnouncement(version=2, path=str(tmp_path / "v2")))
    cursor, found = await transport.updates(cursor, block_ms=10)
    assert [a.version for a in found] == [2]
    assert await transport.updates(cursor, block_ms=10) == (cursor, [])
    latest = await latest_announcement(aredis_client)
    assert latest is not None and latest.version == 2
    newest_first = await setup_weight_transport(client=aredis_client).updates(None, block_ms=10)
    assert [a.version for a in newest_first[1]] == [2, 1]
