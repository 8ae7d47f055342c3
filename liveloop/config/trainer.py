"""Settings of the training loop (`liveloop train`)."""

from typing import Literal

from pydantic import Field

from liveloop.config.base import Section


class LoraSettings(Section):
    """Optional LoRA adapters through peft."""

    enabled: bool = Field(False, description="Train LoRA adapters instead of all weights.")
    rank: int = Field(8, ge=1, description="LoRA rank.")
    alpha: int = Field(16, ge=1, description="LoRA alpha.")


class TrainerConfig(Section):
    """Decoupled PPO hyper-parameters and checkpoint publishing."""

    device: str = Field("cpu", description="Torch device for training.")
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    eps_low: float = Field(0.2, ge=0, description="Lower PPO clip range.")
    eps_high: float = Field(0.28, ge=0, description="Upper PPO clip range.")
    iw_cap: float = Field(5.0, gt=1, description="Cap on the behaviour importance weight.")
    iw_cap_mode: Literal["mask", "clamp"] = Field(
        "mask", description="Tokens over the cap are masked out or clamped to it."
    )
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of a KL penalty to the frozen reference.")
    micro_batch_tokens: int = Field(
        2048, ge=16, description="Tokens per forward/backward micro-batch."
    )
    keep_checkpoints: int = Field(3, ge=1, description="Checkpoints kept on disk.")
    lora: LoraSettings = Field(default_factory=LoraSettings)
