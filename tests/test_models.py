"""Model resolution: aliases, caching, and one-line errors for bad model specs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from liveloop.models import ModelLoadError, load_model, resolve_model_dir


def test_tiny_random_is_small_seeded_and_cached() -> None:
    first = resolve_model_dir("tiny-random")
    stamp = (first / "model.safetensors").stat().st_mtime
    lm = load_model("tiny-random")
    params = sum(p.numel() for p in lm.model.parameters())
    assert 1_000_000 < params < 10_000_000
    assert lm.model.dtype == torch.float32
    assert lm.tokenizer.chat_template and "<|im_start|>" in lm.tokenizer.chat_template
    assert resolve_model_dir("tiny-random") == first
    assert (first / "model.safetensors").stat().st_mtime == stamp  # not rebuilt


def test_local_hf_directory_loads(tmp_path: Path) -> None:
    lm = load_model("tiny-random")
    lm.model.save_pretrained(tmp_path / "m")
    lm.tokenizer.save_pretrained(tmp_path / "m")
    again = load_model(str(tmp_path / "m"))
    for (name, a), (_n, b) in zip(
        lm.model.state_dict().items(), again.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing-dir", "unknown model"),
        (lambda p: p / "missing.gguf", "GGUF file not found"),
        (
            lambda p: (p / "x.gguf").write_bytes(b"not a gguf at all") and p / "x.gguf",
            "cannot read GGUF",
        ),
        (lambda p: (p / "d").mkdir() or p / "d", "no config.json"),
    ],
)
def test_bad_specs_raise_one_line(tmp_path: Path, make: object, message: str) -> None:
    spec = make(tmp_path)  # type: ignore[operator]
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model(str(spec))
    assert "\n" not in str(info.value)


def test_corrupt_safetensors_is_a_load_error(tmp_path: Path) -> None:
    lm = load_model("tiny-random")
    lm.model.save_pretrained(tmp_path)
    lm.tokenizer.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage" * 10)
    with pytest.raises(ModelLoadError, match="cannot load model"):
        load_model(str(tmp_path))


@pytest.mark.slow
def test_smollm2_alias_converted_from_the_wheel_gguf() -> None:
    path = resolve_model_dir("smollm2-135m")
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    lm = load_model("smollm2-135m")
    assert lm.model.config.num_hidden_layers == 30
    ids = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_dict=False,
    )
    out = lm.model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert "Paris" in lm.tokenizer.decode(out[0][len(ids) :])
