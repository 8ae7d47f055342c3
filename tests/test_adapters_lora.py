"""The batched LoRA arithmetic and the PEFT adapter reader, on plain tensors and files.

The bank/step tests compare each row's update with the textbook `scaling * x A^T B^T`
computed row by row; the reader tests use adapters written by PEFT itself and files
broken on purpose.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from liveloop.models import LoadedModel, load_model
from liveloop.server.engine.lora import LoraBank, LoraPair, LoraStep
from liveloop.weights.adapter import (
    AdapterError,
    check_adapter_layout,
    read_adapter,
    read_adapter_config,
)
from tests.support.adapters import make_adapter

IN, OUT = 12, 7
KEY = (0, "q_proj")
OTHER = (0, "v_proj")


def pair(rank: int, seed: int, scaling: float = 1.5) -> LoraPair:
    g = torch.Generator().manual_seed(seed)
    return LoraPair(
        torch.randn(rank, IN, generator=g), torch.randn(OUT, rank, generator=g), scaling
    )


def reference(x: torch.Tensor, p: LoraPair | None) -> torch.Tensor:
    """One row's update, the textbook way."""
    if p is None:
        return torch.zeros(x.shape[0], OUT)
    return p.scaling * (x @ p.a.t()) @ p.b.t()


def new_bank() -> LoraBank:
    return LoraBank({KEY: (IN, OUT), OTHER: (IN, OUT)}, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize(
    "slots",
    [[1, 2, 0, 3, 2], [3, 1, 2], [2, 1, 1, 1, 2], [1, 3, 3], [1, 7], [2, 2, 2], [0, 3, 0, 3], [1]],
    ids=[
        "mixed",
        "all-distinct",
        "uneven",
        "slot-gap",
        "far-apart",
        "one-adapter",
        "one-adapter-and-base",
        "single-row",
    ],
)
def test_each_row_gets_its_own_adapters_update(slots: list[int]) -> None:
    pairs = {1: pair(4, 1), 2: pair(2, 2, scaling=0.5), 3: pair(8, 3), 7: pair(3, 7)}
    bank = new_bank()
    for slot, p in pairs.items():
        bank.put(slot, {KEY: p})
    x = torch.randn(len(slots), 3, IN)
    step = LoraStep(bank, slots)
    got = step.delta(KEY, x)
    assert got is not None and got.shape == (len(slots), 3, OUT)
    for row, slot in enumerate(slots):
        want = reference(x[row], pairs.get(slot))
        torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-5)
    assert step.delta(OTHER, x) is None  # no adapter touches v_proj


def test_a_base_only_step_is_none_and_a_cleared_slot_is_zero() -> None:
    bank = new_bank()
    bank.put(1, {KEY: pair(4, 1), OTHER: pair(4, 9)})
    assert not LoraStep(bank, [0, 0]).active
    bank.clear(1)
    x = torch.randn(2, 1, IN)
    delta = LoraStep(bank, [1, 0]).delta(KEY, x)
    assert delta is None or not delta.any()


def test_a_larger_rank_arriving_keeps_the_resident_adapters_exact() -> None:
    bank = new_bank()
    small = pair(2, 1)
    bank.put(1, {KEY: small})
    assert bank.rank == 2
    big = pair(16, 2)
    bank.put(5, {KEY: big, OTHER: pair(16, 3)})  # grows slots and rank, adds v_proj
    assert bank.rank == 16 and bank.capacity >= 6
    x = torch.randn(2, 1, IN)
    got = LoraStep(bank, [1, 5]).delta(KEY, x)
    assert got is not None
    torch.testing.assert_close(got[0], reference(x[0], small), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], reference(x[1], big), rtol=1e-5, atol=1e-5)
    other = LoraStep(bank, [1, 5]).delta(OTHER, x)  # slot 1 has no v_proj update: zeros
    assert other is not None and not other[0].any() and other[1].any()


def test_replacing_a_slot_drops_the_linears_the_new_version_lacks() -> None:
    bank = new_bank()
    bank.put(1, {KEY: pair(4, 1), OTHER: pair(4, 2)})
    newer = pair(4, 3)
    bank.put(1, {KEY: newer})
    x = torch.randn(1, 1, IN)
    step = LoraStep(bank, [1])
    assert step.delta(OTHER, x) is None
    got = step.delta(KEY, x)
    assert got is not None
    torch.testing.assert_close(got[0], reference(x[0], newer), rtol=1e-5, atol=1e-5)


def test_slot_zero_is_the_base_and_cannot_be_written() -> None:
    with pytest.raises(ValueError, match="slot 0"):
        new_bank().put(0, {KEY: pair(2, 1)})
    with pytest.raises(ValueError, match="no adaptable linear"):
        new_bank().put(1, {(3, "q_proj"): pair(2, 1)})


# ---------------------------------------------------------------------- the PEFT reader


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


@pytest.fixture(scope="module")
def base_shapes(tiny: LoadedModel) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t.shape) for n, t in tiny.model.state_dict().items()}


def test_scaling_follows_peft_for_rslora_and_patterns(
    tiny: LoadedModel, tmp_path: Path, base_shapes: dict[str, tuple[int, ...]]
) -> None:
    plain = make_adapter(tiny.model, tmp_path / "plain", 1, rank=4, alpha=8, merge=False)
    rs = make_adapter(tiny.model, tmp_path / "rs", 2, rank=4, alpha=8, merge=False, use_rslora=True)
    patterned = make_adapter(
        tiny.model,
        tmp_path / "pat",
        3,
        rank=4,
        alpha=8,
        merge=False,
        rank_pattern={"v_proj": 2},
        alpha_pattern={r"layers\.1\.self_attn\.q_proj": 3},
    )
    q0, q1, v0 = (
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
    )
    assert read_adapter(plain.path, base_shapes).modules[q0][2] == 8 / 4
    assert read_adapter(rs.path, base_shapes).modules[q0][2] == pytest.approx(8 / math.sqrt(4))
    modules = read_adapter(patterned.path, base_shapes).modules
    assert modules[q0][2] == 8 / 4
    assert modules[q1][2] == 3 / 4
    assert modules[v0][0].shape[0] == 2 and modules[v0][2] == 8 / 2


def corrupt(src: Path, dst: Path, how: str) -> Path:
    """A copy of an adapter directory broken one way."""
    dst.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    tensors = load_file(str(src / "adapter_model.safetensors"))
    name = next(n for n in sorted(tensors) if n.endswith("q_proj.lora_A.weight"))
    if how == "nan":
        tensors[name] = tensors[name].clone()
        tensors[name][0, 0] = float("nan")
    elif how == "shape":
        tensors[name] = torch.zeros(tensors[name].shape[0], tensors[name].shape[1] + 1)
    elif how == "unknown-module":
        tensors[name.replace("layers.0", "layers.7")] = tensors.pop(name)
        b = name.replace("lora_A", "lora_B")
        tensors[b.replace("layers.0", "layers.7")] = tensors.pop(b)
    elif how == "missing-b":
        del tensors[name.replace("lora_A", "lora_B")]
    elif how == "rank":
        config["r"] = config["r"] + 1
    elif how == "dora":
        config["use_dora"] = True
    (dst / "adapter_config.json").write_text(json.dumps(config))
    if how == "no-weights":
        return dst
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    if how == "truncated":
        data = (dst / "adapter_model.safetensors").read_bytes()
        (dst / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    return dst


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("nan", "NaN"),
        ("shape", "base weight has shape"),
        ("unknown-module", "no linear model.layers.7"),
        ("missing-b", "no lora_B"),
        ("rank", "do not have rank"),
        ("dora", "use_dora"),
        ("no-weights", "no adapter_model.safetensors"),
        ("truncated", "unreadable"),
    ],
)
def test_broken_adapters_are_refused_with_the_reason(
    tiny: LoadedModel,
    tmp_path: Path,
    base_shapes: dict[str, tuple[int, ...]],
    how: str,
    message: str,
) -> None:
    good = make_adapter(tiny.model, tmp_path / "good", 1, rank=4, merge=False)
    read_adapter(good.path, base_shapes)  # the unbroken one is accepted
    with pytest.raises(AdapterError, match=message):
        read_adapter(corrupt(good.path, tmp_path / how, how), base_shapes)


def test_layout_check_needs_no_tensors(tmp_path: Path, tiny: LoadedModel) -> None:
    made = make_adapter(tiny.model, tmp_path / "a", 1, rank=4, merge=False)
    config = read_adapter_config(made.path)
    shapes = {
        n: tuple(t.shape)
        for n, t in load_file(str(made.path / "adapter_model.safetensors")).items()
    }
    layout = check_adapter_layout(config, shapes)
    assert len(layout) == 2 * 7  # two layers, seven linears each
    assert {m.rank for m in layout.values()} == {4}
    with pytest.raises(AdapterError, match="not found"):
        read_adapter_config(tmp_path / "missing")
