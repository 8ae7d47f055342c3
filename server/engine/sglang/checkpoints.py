"""Checking a checkpoint directory before any SGLang replica loads it, without torch.

Why here: SGLang 0.5's `update_weights_from_disk` kills the whole server when a
safetensors file is unreadable or a tensor does not fit (its rollback re-reads the same
bad path), and it loads NaNs without complaint. So the gateway refuses such a checkpoint
itself, the way the torch engine does: every safetensors header must parse and lie within
its file, the tensor names and shapes must be those of the served model, and (with
`scan`) no floating-point value may be NaN or infinite. Everything is read with the
standard library and numpy (memory-mapped), so the gateway's process never imports torch.

A checkpoint is a full Hugging Face model directory (config.json + safetensors, one file
or shards listed in `model.safetensors.index.json`), as the trainer writes it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from liveloop.weights import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
HEADER_LIMIT = 100 * 1024 * 1024
ITEM_SIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
# (numpy unsigned view, exponent mask): a float is NaN or inf when all exponent bits are set.
EXPONENT = {
    "F64": ("<u8", 0x7FF0000000000000),
    "F32": ("<u4", 0x7F800000),
    "F16": ("<u2", 0x7C00),
    "BF16": ("<u2", 0x7F80),
}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in a safetensors file, and what it is."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file; CheckpointError if the file is malformed."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            raw_len = fh.read(8)
            if len(raw_len) != 8:
                raise CheckpointError(f"{path} is too short to be a safetensors file")
            (length,) = struct.unpack("<Q", raw_len)
            if length > min(HEADER_LIMIT, size - 8):
                raise CheckpointError(f"{path}: safetensors header length {length} is invalid")
            header = json.loads(fh.read(length))
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not an object")
    base = 8 + length
    tensors: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _tensor_info(path, name, meta, base, size)
    return tensors


def _tensor_info(path: Path, name: str, meta: object, base: int, size: int) -> TensorInfo:
    try:
        assert isinstance(meta, dict)
        dtype = str(meta["dtype"])
        shape = tuple(int(d) for d in meta["shape"])
        begin, stop = (int(x) for x in meta["data_offsets"])
    except (AssertionError, KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: malformed entry for tensor {name!r}") from None
    count = 1
    for dim in shape:
        count *= dim
    item = ITEM_SIZE.get(dtype)
    if item is None:
        raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {dtype}")
    if not 0 <= begin <= stop or stop - begin != count * item or base + stop > size:
        raise CheckpointError(f"{path}: tensor {name!r} lies outside the file or is truncated")
    return TensorInfo(path, dtype, shape, base + begin, base + stop)


def tensor_index(directory: Path) -> dict[str, TensorInfo]:
    """Every tensor of a model directory (sharded or not); CheckpointError if unusable."""
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint not found: {directory}")
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{directory} is not a model directory (no config.json)")
    index = directory / INDEX_NAME
    promised: set[str] | None = None
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            promised = set(weight_map)
            files = sorted({directory / str(v) for v in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"unreadable shard index {index}: {exc}") from None
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors file in checkpoint directory {directory}")
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"checkpoint {directory} lacks shard file {file.name}")
        for name, info in read_header(file).items():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} appears twice (again in {file.name})")
            tensors[name] = info
    if promised is not None and promised != set(tensors):
        raise CheckpointError(f"checkpoint {directory} does not match its shard index")
    return tensors


def check_finite(info: TensorInfo, name: str) -> None:
    """CheckpointError if a floating-point tensor holds NaN or infinite values."""
    import numpy as np

    spec = EXPONENT.get(info.dtype)
    if spec is None or info.end == info.start:
        return
    view, mask = spec
    data = np.memmap(info.file, dtype=view, mode="r", offset=info.start,
                     shape=((info.end - info.start) // np.dtype(view).itemsize,))  # fmt: skip
    if bool(((data & np.array(mask, dtype=view)) == mask).any()):
        raise CheckpointError(f"tensor {name!r} holds NaN or infinite values")


def validate_checkpoint(
    path: Path, reference: dict[str, TensorInfo] | None, scan: bool = True
) -> None:
    """Refuse a checkpoint that SGLang could not load or that would serve garbage.

    `reference` is the served model's tensor index: the checkpoint must hold the same
    names with the same shapes (dtypes may differ: SGLang casts to its own).
    """
    tensors = tensor_index(path)
    if reference is not None:
        missing = sorted(set(reference) - set(tensors))[:5]
        extra = sorted(set(tensors) - set(reference))[:5]
        if missing or extra:
            raise CheckpointError(
                f"checkpoint {path} does not fit the model: missing {missing}, unknown {extra}"
            )
        for name, info in tensors.items():
            if info.shape != reference[name].shape:
                raise CheckpointError(
                    f"checkpoint {path} does not fit the model: {name} has shape "
                    f"{list(info.shape)}, the model {list(reference[name].shape)}"
                )
    if scan:
        for name, info in tensors.items():
            check_finite(info, name)


def map_path(path: str, mapping: dict[str, str]) -> str:
    """The path as the SGLang servers see it: the longest matching prefix replaced."""
    best = ""
    for prefix in mapping:
        trimmed = prefix.rstrip("/")
        if (path == trimmed or path.startswith(trimmed + "/")) and len(trimmed) > len(best):
            best = trimmed
    if not best:
        return path
    return mapping[best if best in mapping else best + "/"].rstrip("/") + path[len(best) :]
