"""Demo presets are plain settings files: `liveloop demo` reads the model's, under yours."""

from __future__ import annotations

from pathlib import Path

import pytest

from liveloop.cli import build_parser, config_files, settings_from_args
from liveloop.config import ConfigError, load_settings, presets


def test_every_preset_is_a_settings_file_up_can_read() -> None:
    models = ["qwen2.5-coder-0.5b", "smollm2-135m", "tiny-random"]
    assert presets.available() == sorted([*models, "tenants"])
    for name in models:
        settings = load_settings(presets.preset_path(name))  # what `up --config` does
        assert settings.model == name and settings.trainer.gate.probe_source == "demo"
    tenants = load_settings(presets.preset_path("tenants"))
    assert tenants.demo.tenants == 3 and tenants.demo.scopes == ["tenant", "shared"]
    assert tenants.trainer.lora.enabled and tenants.trainer.gate.probe_source == "served"
    assert tenants.demo.retries_after_complaint == 2  # the one-tenant presets keep 0
    smollm2 = load_settings(presets.preset_path("smollm2-135m"))
    assert smollm2.trainer.lora.enabled and smollm2.trainer.lora.rank == 16
    assert smollm2.demo.turns_per_update == 24 and smollm2.demo.objectives == ["rl"]
    assert smollm2.demo.retries_after_complaint == 0
    qwen = load_settings(presets.preset_path("qwen2.5-coder-0.5b"))
    assert qwen.trainer.lora.enabled and qwen.demo.sense_model is None  # the judge: opt-in


def test_the_demo_reads_its_preset_under_your_file_and_flags(tmp_path: Path) -> None:
    mine = tmp_path / "mine.toml"
    mine.write_text("[trainer]\nlr = 0.5\n[trainer.lora]\nrank = 4\n")
    args = build_parser().parse_args(["demo", "--model", "smollm2-135m", "--config", str(mine)])
    assert config_files(args, "smollm2-135m") == [presets.preset_path("smollm2-135m"), mine]
    settings = settings_from_args(args)
    assert settings.trainer.lr == 0.5  # yours over the preset
    assert settings.trainer.lora.rank == 4 and settings.trainer.lora.enabled  # merged, not replaced
    assert settings.trainer.micro_batch_tokens == 1024  # the preset's
    up = settings_from_args(build_parser().parse_args(["up", "--config", str(mine)]))
    assert not up.trainer.lora.enabled and up.trainer.gate.probe_source == "auto"  # no preset
    by_name = build_parser().parse_args(["demo", "--preset", "tiny-random"])
    chosen = settings_from_args(by_name)
    assert chosen.model == "tiny-random" and chosen.demo.objectives == ["combine"]
    tenants_demo = build_parser().parse_args(["demo", "--tenants", "2", "--scope", "shared"])
    assert config_files(tenants_demo, "smollm2-135m") == [presets.preset_path("tenants")]
    two = settings_from_args(tenants_demo)
    assert two.demo.tenants == 2 and two.demo.scopes == ["shared"]
    with pytest.raises(ConfigError, match="unknown preset 'nope'"):
        settings_from_args(build_parser().parse_args(["demo", "--preset", "nope"]))
