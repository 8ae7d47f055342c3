"""LoRA adapters for tests, made with PEFT itself (`get_peft_model` + `save_pretrained`).

PEFT initialises B to zero (an adapter that changes nothing), so B gets seeded random
values: every adapter made here changes the model's outputs, each in its own way. The
same seed gives the same adapter. `merged` is the reference: the base with the adapter
merged into its weights (`merge_and_unload`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ALL_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class MadeAdapter:
    """An adapter directory and the base model with that adapter merged in."""

    path: Path
    merged: Any


def make_adapter(
    base: Any,
    path: Path,
    seed: int,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    targets: tuple[str, ...] = ALL_LINEARS,
    scale: float = 0.2,
    merge: bool = True,
    **config: Any,
) -> MadeAdapter:
    """Save a PEFT LoRA adapter of `base` (not modified) with seeded random A and B.

    `config`: more `LoraConfig` settings (use_rslora, rank_pattern, alpha_pattern, ...).
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        **config,
    )
    model = get_peft_model(copy.deepcopy(base), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
                param.copy_((noise * scale).to(param.dtype))
    model.save_pretrained(str(path))
    merged = model.merge_and_unload() if merge else None
    if merged is not None:
        merged.eval()
    return MadeAdapter(path, merged)
