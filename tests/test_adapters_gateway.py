"""The SGLang gateway's side of adapters that needs no SGLang server: the launch flags and
the torch-free check of an adapter against the served model's files (tiny-random)."""

from __future__ import annotations

from pathlib import Path

import pytest

from liveloop.config import SGLangConfig
from liveloop.models import LoadedModel, load_model, resolve_model_dir
from liveloop.server.engine.sglang.adapters import lora_name, validate_adapter
from liveloop.server.engine.sglang.checkpoints import tensor_index
from liveloop.server.engine.sglang.launcher import launch_command
from liveloop.weights.adapter import AdapterError
from tests.support.adapters import make_adapter
from tests.test_adapters_lora import corrupt


def flag_values(cmd: list[str], flag: str) -> list[str]:
    """The values after `flag` up to the next flag."""
    start = cmd.index(flag) + 1
    end = next((i for i in range(start, len(cmd)) if cmd[i].startswith("--")), len(cmd))
    return cmd[start:end]


def test_launched_servers_get_the_lora_flags_and_launch_args_win() -> None:
    plain = launch_command("py", "/m", 1, SGLangConfig(device="cpu"))
    assert "--enable-lora" not in plain
    cfg = SGLangConfig(
        device="cpu",
        enable_lora=True,
        max_loras_per_batch=3,
        max_lora_rank=32,
        lora_target_modules=["q_proj", "v_proj"],
    )
    cmd = launch_command("py", "/m", 1, cfg)
    assert "--enable-lora" in cmd
    assert flag_values(cmd, "--max-loras-per-batch") == ["3"]
    assert flag_values(cmd, "--max-lora-rank") == ["32"]
    assert flag_values(cmd, "--lora-target-modules") == ["q_proj", "v_proj"]
    assert flag_values(cmd, "--lora-backend") == ["torch_native"]  # CPU default
    gpu = launch_command("py", "/m", 1, cfg.model_copy(update={"device": "cuda"}))
    assert "--lora-backend" not in gpu  # SGLang's own choice on GPUs
    mine = cfg.model_copy(update={"launch_args": ["--max-lora-rank", "8"]})
    assert launch_command("py", "/m", 1, mine).count("--max-lora-rank") == 1
    assert lora_name("tenant-a", 7) == "tenant-a@v7"


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


def test_the_gateway_refuses_adapters_the_servers_could_not_serve(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    base = tensor_index(resolve_model_dir("tiny-random"))
    cfg = SGLangConfig(enable_lora=True, max_lora_rank=8)
    good = make_adapter(tiny.model, tmp_path / "good", 1, rank=8, merge=False)
    assert validate_adapter(good.path, base, cfg).rank == 8
    big = make_adapter(tiny.model, tmp_path / "big", 2, rank=16, merge=False)
    with pytest.raises(AdapterError, match="at most 8"):
        validate_adapter(big.path, base, cfg)
    narrow = cfg.model_copy(update={"lora_target_modules": ["q_proj", "k_proj", "v_proj"]})
    with pytest.raises(AdapterError, match=r"cannot adapt model\.layers\.0\.mlp\.down_proj"):
        validate_adapter(good.path, base, narrow)
    for how, message in (("nan", "NaN"), ("shape", "base weight"), ("truncated", "truncated")):
        with pytest.raises(AdapterError, match=message):
            validate_adapter(corrupt(good.path, tmp_path / how, how), base, cfg)
