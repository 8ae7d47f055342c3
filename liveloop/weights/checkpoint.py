"""Reading a checkpoint's tensors, refusing anything unusable (the format's reader).

A checkpoint is what `save_pretrained` writes (one `model.safetensors`, or shards listed
in `model.safetensors.index.json`) or a single `.safetensors` file. Everything that can
be wrong with the files themselves is reported as a `CheckpointError` naming the problem:
`check_checkpoint` reads only the safetensors headers (cheap), `load_checkpoint_state_dict`
reads every tensor and also refuses NaN or infinite values. Whether names, shapes and
dtypes fit a live model is the engine's check (`validate_state_dict`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint cannot be used (missing, unreadable, wrong names/shapes/dtypes, NaN/inf)."""


def _index_files(directory: Path) -> tuple[list[Path], set[str] | None]:
    """Shard files of a checkpoint dir and, for a sharded one, the tensor names promised."""
    index = directory / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = set(weight_map)
            shards = sorted({str(v) for v in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"unreadable shard index {index}: {exc}") from None
        files = [directory / shard for shard in shards]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"checkpoint {directory} lacks shard file(s) {missing}")
        return files, names
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        if (directory / "adapter_config.json").is_file():
            raise CheckpointError(f"{directory} holds a LoRA adapter; merge it into the model")
        raise CheckpointError(f"no *.safetensors file in checkpoint directory {directory}")
    if (directory / "adapter_config.json").is_file() and all(
        f.name.startswith("adapter_model") for f in files
    ):
        raise CheckpointError(f"{directory} holds a LoRA adapter; merge it into the model")
    return files, None


def _files(path: Path) -> tuple[list[Path], set[str] | None]:
    """The safetensors files of a checkpoint (dir or single file) and the names promised."""
    if path.is_dir():
        return _index_files(path)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{path} is not a .safetensors file or a checkpoint directory")
        return [path], None
    raise CheckpointError(f"checkpoint not found: {path}")


def _check_names(path: Path, found: list[str], promised: set[str] | None) -> None:
    if not found:
        raise CheckpointError(f"checkpoint {path} holds no tensors")
    if len(set(found)) != len(found):
        twice = sorted({n for n in found if found.count(n) > 1})[:5]
        raise CheckpointError(f"tensor(s) {twice} appear more than once in {path}")
    if promised is not None and promised != set(found):
        missing = sorted(promised - set(found))[:5]
        extra = sorted(set(found) - promised)[:5]
        raise CheckpointError(
            f"checkpoint {path} does not match its index: missing {missing}, unlisted {extra}"
        )


def check_checkpoint(path: str | Path) -> None:
    """Raise CheckpointError unless every file is there and its header readable (no tensors read)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    files, promised = _files(path)
    names: list[str] = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                names += list(handle.keys())
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"unreadable safetensors file {file}: {exc}") from None
    _check_names(path, names, promised)


def _read_file(path: Path, into: dict[str, torch.Tensor]) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"unreadable safetensors file {path}: {exc}") from None
    for name, tensor in tensors.items():
        if name in into:
            raise CheckpointError(f"tensor {name!r} appears twice (again in {path.name})")
        into[name] = tensor


def _check_finite(state_dict: dict[str, torch.Tensor]) -> None:
    import torch

    for name, tensor in state_dict.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"tensor {name!r} holds NaN or infinite values")


def load_checkpoint_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint (dir or single file) on CPU; raises CheckpointError."""
    path = Path(path)
    files, promised = _files(path)
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        _read_file(file, state_dict)
    _check_names(path, list(state_dict), promised)
    _check_finite(state_dict)
    return state_dict
