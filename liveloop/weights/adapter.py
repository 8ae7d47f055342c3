"""LoRA adapters in the PEFT layout: reading one and refusing what does not fit the base.

An adapter version is a directory as `PeftModel.save_pretrained` writes it:

    adapter_config.json          peft_type "LORA", r, lora_alpha, target_modules,
                                 use_rslora, rank_pattern, alpha_pattern, ...
    adapter_model.safetensors    for each adapted linear `<module>` of the base model:
                                 base_model.model.<module>.lora_A.weight   [r, in]
                                 base_model.model.<module>.lora_B.weight   [out, r]

The update of a linear is `scaling * B @ A`, with `scaling = lora_alpha / r` (or
`lora_alpha / sqrt(r)` under `use_rslora`); `rank_pattern` / `alpha_pattern` override r
and alpha for the modules whose name matches a pattern, as PEFT does.

Shared by whatever serves or writes adapters: `read_adapter_config` and
`check_adapter_layout` need neither torch nor the tensors (the SGLang gateway checks
safetensors headers with them), `read_adapter` loads the tensors with torch and also
refuses NaN or infinite values. Every refusal is an `AdapterError` (a `CheckpointError`)
naming the problem. Only plain LoRA on linear layers is accepted: DoRA, trained biases,
`modules_to_save` and embedding adapters are refused.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from liveloop.weights.checkpoint import CheckpointError

if TYPE_CHECKING:
    import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."
A_SUFFIX = ".lora_A.weight"
B_SUFFIX = ".lora_B.weight"
# Settings that change what the files mean in ways a plain LoRA reader cannot follow.
_REFUSED_IF_SET = ("use_dora", "lora_bias", "layer_replication", "target_parameters")


class AdapterError(CheckpointError):
    """A LoRA adapter cannot be used (missing files, unsupported settings, wrong
    names/shapes against the base model, NaN/inf)."""


@dataclass(frozen=True)
class AdapterConfig:
    """What `adapter_config.json` says about how to apply the tensors."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...] | str
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    base_model: str | None = None

    def rank_of(self, module: str) -> int:
        """r of one module (`rank_pattern` first, as PEFT matches it)."""
        key = _pattern_key(self.rank_pattern, module)
        return int(self.rank_pattern[key]) if key is not None else self.rank

    def scaling_of(self, module: str) -> float:
        """The factor of `B @ A` for one module."""
        key = _pattern_key(self.alpha_pattern, module)
        alpha = float(self.alpha_pattern[key]) if key is not None else self.alpha
        rank = self.rank_of(module)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _pattern_key(patterns: Mapping[str, Any], module: str) -> str | None:
    """The first pattern matching the module name's tail (PEFT's `get_pattern_key`)."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


def is_adapter_dir(path: str | Path) -> bool:
    """Whether `path` is a directory holding an adapter (an `adapter_config.json`)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def read_adapter_config(directory: str | Path) -> AdapterConfig:
    """Parse `adapter_config.json`; AdapterError if missing, malformed or unsupported."""
    path = Path(directory) / ADAPTER_CONFIG
    if not Path(directory).is_dir():
        raise AdapterError(f"adapter not found: {directory}")
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{directory} has no {ADAPTER_CONFIG}") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"unreadable {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{path} does not hold a JSON object")
    if str(raw.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{path}: peft_type {raw.get('peft_type')!r} is not LORA")
    for name in _REFUSED_IF_SET:
        if raw.get(name):
            raise AdapterError(f"{path}: {name} is not supported")
    if raw.get("bias", "none") != "none":
        raise AdapterError(f"{path}: trained biases (bias={raw.get('bias')!r}) are not supported")
    if raw.get("modules_to_save"):
        raise AdapterError(f"{path}: modules_to_save is not supported")
    if raw.get("fan_in_fan_out"):
        raise AdapterError(f"{path}: fan_in_fan_out (Conv1D layers) is not supported")
    try:
        config = AdapterConfig(
            rank=int(raw.get("r", 8)),
            alpha=float(raw.get("lora_alpha", 8)),
            target_modules=_targets(raw.get("target_modules")),
            use_rslora=bool(raw.get("use_rslora", False)),
            rank_pattern={str(k): int(v) for k, v in (raw.get("rank_pattern") or {}).items()},
            alpha_pattern={str(k): float(v) for k, v in (raw.get("alpha_pattern") or {}).items()},
            base_model=raw.get("base_model_name_or_path"),
        )
    except (TypeError, ValueError, AttributeError) as exc:
        raise AdapterError(f"{path}: malformed setting ({exc})") from None
    ranks = [config.rank, *config.rank_pattern.values()]
    if min(ranks) < 1:
        raise AdapterError(f"{path}: r must be at least 1")
    return config


def _targets(value: object) -> tuple[str, ...] | str:
    if isinstance(value, str):
        return value
    if isinstance(value, list | tuple):
        return tuple(str(v) for v in value)
    raise ValueError(f"target_modules {value!r} is neither a list nor a pattern")


@dataclass(frozen=True)
class ModuleLayout:
    """One adapted linear: its module name, rank, in/out features and scaling."""

    module: str
    rank: int
    fan_in: int
    fan_out: int
    scaling: float


def check_adapter_layout(
    config: AdapterConfig,
    shapes: Mapping[str, tuple[int, ...]],
    base: Mapping[str, tuple[int, ...]] | None = None,
) -> dict[str, ModuleLayout]:
    """The adapted linears of an adapter from its tensor names and shapes, checked.

    `shapes` maps the adapter file's tensor names to shapes; `base` (optional) maps the
    base model's tensor names to shapes (`model.layers.0.self_attn.q_proj.weight` ...).
    Every module must have both an A `[r, in]` and a B `[out, r]` with the configured r
    and, given `base`, be a 2-D weight of the base model of shape `[out, in]`.
    """
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        module, part = _split_key(name)
        pairs.setdefault(module, {})[part] = tuple(shape)
    if not pairs:
        raise AdapterError("the adapter holds no LoRA tensors")
    layout: dict[str, ModuleLayout] = {}
    for module, parts in sorted(pairs.items()):
        if set(parts) != {"A", "B"}:
            missing = "lora_B" if "A" in parts else "lora_A"
            raise AdapterError(f"{module} has no {missing} weight")
        a, b = parts["A"], parts["B"]
        rank = config.rank_of(module)
        if len(a) != 2 or len(b) != 2 or a[0] != rank or b[1] != rank:
            raise AdapterError(
                f"{module}: lora_A {list(a)} / lora_B {list(b)} do not have rank {rank}"
            )
        if base is not None:
            weight = base.get(f"{module}.weight")
            if weight is None:
                raise AdapterError(f"the base model has no linear {module}")
            if tuple(weight) != (b[0], a[1]):
                raise AdapterError(
                    f"{module}: the adapter maps {a[1]} -> {b[0]} features, the base "
                    f"weight has shape {list(weight)}"
                )
        layout[module] = ModuleLayout(module, rank, a[1], b[0], config.scaling_of(module))
    return layout


def _split_key(name: str) -> tuple[str, str]:
    """(`model.layers.0.self_attn.q_proj`, "A" | "B") of a PEFT tensor name."""
    if not name.startswith(KEY_PREFIX):
        raise AdapterError(f"unexpected tensor {name!r} (PEFT names start with {KEY_PREFIX!r})")
    for suffix, part in ((A_SUFFIX, "A"), (B_SUFFIX, "B")):
        if name.endswith(suffix):
            return name[len(KEY_PREFIX) : -len(suffix)], part
    raise AdapterError(f"unsupported tensor {name!r} (only lora_A/lora_B weights are served)")


@dataclass
class LoraAdapter:
    """An adapter's tensors on CPU: module name -> (A `[r, in]`, B `[out, r]`, scaling)."""

    config: AdapterConfig
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]]

    @property
    def max_rank(self) -> int:
        """The largest rank of any module."""
        return max(int(a.shape[0]) for a, _, _ in self.modules.values())


def read_adapter(
    directory: str | Path, base: Mapping[str, tuple[int, ...]] | None = None
) -> LoraAdapter:
    """Load and check an adapter directory (see `check_adapter_layout`); AdapterError."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = read_adapter_config(directory)
    weights = Path(directory) / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise AdapterError(f"{directory} has no {ADAPTER_WEIGHTS}")
    try:
        tensors = load_file(str(weights), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise AdapterError(f"unreadable {weights}: {exc}") from None
    layout = check_adapter_layout(config, {n: tuple(t.shape) for n, t in tensors.items()}, base)
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for module, info in layout.items():
        a = tensors[KEY_PREFIX + module + A_SUFFIX]
        b = tensors[KEY_PREFIX + module + B_SUFFIX]
        for tensor, part in ((a, "lora_A"), (b, "lora_B")):
            if not tensor.is_floating_point():
                raise AdapterError(f"{module}.{part} is not a floating-point tensor")
            if not bool(torch.isfinite(tensor).all()):
                raise AdapterError(f"{module}.{part} holds NaN or infinite values")
        modules[module] = (a, b, info.scaling)
    return LoraAdapter(config, modules)
