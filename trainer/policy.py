"""The trainable policy: loading (fresh or from a checkpoint), LoRA, reference, export.

The trainer always starts from `settings.model` (version 0) or from its newest checkpoint.
With LoRA the adapters are trained on top of the base weights; a version is published as
the adapter alone, or merged into a full copy (`trainer.publish`). Log-probs of completion
tokens are computed here, projecting only the positions that predict completion tokens.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from liveloop.config.trainer import LoraSettings
from liveloop.models import load_model
from liveloop.trainer.data import MicroBatch

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class Policy:
    """The model being trained, its tokenizer, and whether it carries LoRA adapters."""

    model: Any  # a PreTrainedModel, or a peft model wrapping one
    tokenizer: PreTrainedTokenizerBase
    lora: bool
    reference: Any | None = None  # frozen initial model for the KL penalty (full fine-tuning)

    @property
    def has_reference(self) -> bool:
        """True when reference log-probs can be computed (a frozen copy, or LoRA's base)."""
        return self.lora or self.reference is not None

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters the optimizer updates, in a fixed order."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def export(self) -> PreTrainedModel:
        """A plain transformers model with the current weights (LoRA merged into a copy)."""
        if not self.lora:
            model: PreTrainedModel = self.model
            return model
        merged = copy.deepcopy(self.model).merge_and_unload()
        result: PreTrainedModel = merged
        return result

    def reference_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """Log-probs of the completion tokens under the frozen initial model (no grad)."""
        import torch

        with torch.no_grad():
            if self.lora:
                with self.model.disable_adapter():
                    return completion_logprobs(self.model, mb)[0]
            if self.reference is None:
                raise RuntimeError("no reference model was loaded")
            return completion_logprobs(self.reference, mb)[0]


def completion_logprobs(
    model: Any, mb: MicroBatch, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each completion token (and the policy's entropy there) for a packed row."""
    import torch

    out = model(
        input_ids=mb.input_ids,
        position_ids=mb.position_ids,
        logits_to_keep=mb.logit_index,
        use_cache=False,
    )
    logits = out.logits[0].float()
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(1, mb.targets[:, None]).squeeze(1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _wrap_lora(model: Any, lora: LoraSettings) -> Any:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def _adapter_of(checkpoint: Path) -> Path | None:
    """The LoRA adapter a checkpoint resumes from: the version itself when it was published
    as an adapter, else the copy kept beside its merged weights (None: there is none)."""
    for place in (checkpoint, checkpoint / "trainer_state" / "adapter"):
        if (place / "adapter_config.json").is_file():
            return place
    return None


def load_policy(
    model_spec: str,
    device: str,
    lora: LoraSettings,
    *,
    checkpoint: Path | None = None,
    with_reference: bool = False,
) -> Policy:
    """Load the policy from `model_spec` or, when given, a checkpoint directory.

    With LoRA, a checkpoint's merged weights are not used: the base model is loaded and the
    adapter saved beside the checkpoint (`trainer_state/adapter`) is restored on top, so
    training continues on the same adapter parameters its optimizer state refers to.
    """
    import torch

    loaded = load_model(model_spec, device=device)
    model: Any = loaded.model
    reference = None
    if lora.enabled:
        adapter = _adapter_of(checkpoint) if checkpoint else None
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
        else:
            model = _wrap_lora(model, lora)
    else:
        if with_reference:
            reference = copy.deepcopy(model).eval()
            reference.requires_grad_(False)
        if checkpoint is not None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
            model.to(device)
    model.train()
    return Policy(model=model, tokenizer=loaded.tokenizer, lora=lora.enabled, reference=reference)
