"""Settings of the training loop (`liveloop train`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from liveloop.config.base import Section
from liveloop.config.consumer import ConsumerSettings, consumer_defaults
from liveloop.config.gate import GateSettings
from liveloop.config.objective import ObjectiveConfig, RLObjectiveConfig
from liveloop.config.opd import OPDSettings
from liveloop.config.watch import WatchSettings


class LoraSettings(Section):
    """Optional LoRA adapters through peft, published as adapters or merged (`publish`)."""

    enabled: bool = Field(False, description="Train LoRA adapters instead of all weights.")
    rank: int = Field(8, ge=1, description="LoRA rank.")
    alpha: int = Field(16, ge=1, description="LoRA alpha.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA branch.")
    target_modules: list[str] | str = Field(
        "all-linear",
        description="Modules that get adapters: a list of names, or 'all-linear'.",
    )
    adapter_name: str = Field(
        "policy",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
        description="The name the adapter is announced and served under (publish = 'adapter', "
        "shared scope; in tenant scope each tenant's adapter is named after its key id).",
    )


class TrainerConfig(Section):
    """Decoupled PPO hyper-parameters and checkpoint publishing."""

    device: str = Field("cpu", description="Torch device for training.")
    scope: Literal["shared", "tenant"] = Field(
        "shared",
        description="Whose traffic a version learns from: 'shared', one policy from every "
        "tenant's judged turns; 'tenant', one LoRA adapter per tenant (API key id), named "
        "after it and trained only on its own turns, gated, rolled back and deleted on its "
        "own (needs trainer.lora.enabled and adapter publishing).",
    )
    max_warm_tenants: int = Field(
        16,
        ge=1,
        description="In tenant scope, how many tenants' adapters and optimizer states are "
        "kept in memory; past it the least recently trained tenant's are dropped and read "
        "back from its newest checkpoint on its next batch.",
    )
    publish: Literal["adapter", "merged"] | None = Field(
        None,
        description="What a version's checkpoint holds: 'adapter', the LoRA adapter alone in "
        "the PEFT layout (adapter_config.json + adapter_model.safetensors), served over the "
        "unchanged base; 'merged', full weights with the adapter merged in. Unset: "
        "'adapter' when training LoRA, full weights otherwise.",
    )
    objective: ObjectiveConfig = Field(
        default_factory=RLObjectiveConfig,
        description=(
            "What each token's advantage is: a name, or a table with `kind`. 'rl': the judged "
            "score (against a baseline). 'opd': hindsight-guided on-policy distillation, "
            "log pi_teacher(token | prompt + the judge's directive hint) - log "
            "pi_proximal(token | prompt); only turns with a hint are trained. 'combine': both, "
            "weighted (trainer.opd); turns without a hint contribute through 'rl' only. "
            "'custom': a class of your own (`import_path`, `options`)."
        ),
    )
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    eps_low: float = Field(0.2, ge=0, description="Lower PPO clip range.")
    eps_high: float = Field(0.28, ge=0, description="Upper PPO clip range.")
    iw_cap: float = Field(
        5.0, gt=1, description="Cap on the behaviour importance weight exp(proximal - behaviour)."
    )
    iw_cap_mode: Literal["mask", "clamp"] = Field(
        "mask", description="Tokens over the cap are masked out or clamped to it."
    )
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    kl_coef: float | None = Field(
        None,
        ge=0,
        description=(
            "Weight of a per-token KL penalty (k3 estimator) to the frozen reference (the "
            "initial model); unset = the model's default (liveloop.config.defaults)."
        ),
    )
    measure_drift: bool = Field(
        True,
        description=(
            "Keep the reference model even without a KL penalty, to measure each version's "
            "reference NLL and KL on the served tokens it trains on."
        ),
    )
    quality_interval_s: float = Field(
        10.0, gt=0, description="How often per-version quality is exported and stored."
    )
    minibatches: int = Field(
        1,
        ge=1,
        description=(
            "Optimizer steps per batch (one policy version). Proximal log-probs are computed "
            "once, before the first step, so clipping acts from the second step on."
        ),
    )
    tenant_minibatches: int | None = Field(
        None,
        ge=1,
        description=(
            "Optimizer steps per batch in tenant scope (unset: `minibatches`). With N tenants "
            "sharing the trainer, each tenant's adapter gets about one batch in N, while a "
            "shared policy takes a step for every batch of everyone's turns; N steps per "
            "batch give an adapter as many steps per judged turn of its own tenant as the "
            "shared policy takes per judged turn."
        ),
    )
    skip_flat_samples: bool = Field(
        False,
        description=(
            "Under the reward-only objective ('rl'), drop samples whose advantage is zero: "
            "every reply of their group scored the same, or their task scores the same every "
            "time against its own baseline. They carry no policy-gradient signal, only the "
            "KL anchor's pull, and a batch of nothing else would cost an update and a gate "
            "round that teach nothing (counted under the `flat` drop reason)."
        ),
    )
    min_update_samples: int = Field(
        1,
        ge=1,
        description=(
            "Fewest samples a batch must keep, after the stale, invalid and flat ones are "
            "dropped, to make an update; a batch with fewer is acknowledged and makes no "
            "version (its samples counted under the `too_few` drop reason). Adam moves each "
            "weight by about the learning rate per step whatever the batch size, so an update "
            "from one or two replies moves a policy as far as one from twenty, in a direction "
            "those few chose, and costs the same gate round. The turns stay in the trace log."
        ),
    )
    fuse_proximal: bool = Field(
        True,
        description=(
            "Take the first minibatch's proximal log-probs from its own gradient forward pass "
            "(same weights, identical values) instead of an extra no-grad pass."
        ),
    )
    share_prefixes: bool = Field(
        True,
        description=(
            "Score a sample whose prompt + completion begin another sample's prompt (an "
            "earlier turn of the same session) in that sample's forward pass, instead of a "
            "pass of its own: the same log-probs from fewer tokens run."
        ),
    )
    micro_batch_tokens: int = Field(
        2048,
        ge=16,
        description="Tokens per forward/backward micro-batch (sequences packed without padding). "
        "Attention over a packed row is masked block-diagonally but computed in full, so on a "
        "CPU shorter rows are often faster.",
    )
    keep_checkpoints: int = Field(3, ge=1, description="Checkpoints kept on disk.")
    max_updates: int | None = Field(
        None, ge=1, description="Stop after this many updates in this run; unset = run forever."
    )
    read_block_ms: int = Field(
        500, ge=10, description="How long one read of liveloop:batches blocks before re-checking."
    )
    consumer: ConsumerSettings = Field(
        default_factory=lambda: consumer_defaults(claim_idle_ms=600_000, read_count=1),
        description="The trainer in consumer group `trainer`: a batch pending claim_idle_ms "
        "on a dead trainer is reclaimed; batches are applied one at a time, whatever "
        "read_count fetches.",
    )
    lora: LoraSettings = Field(default_factory=LoraSettings)
    gate: GateSettings = Field(default_factory=GateSettings)
    watch: WatchSettings = Field(default_factory=WatchSettings)
    opd: OPDSettings = Field(default_factory=OPDSettings)

    @model_validator(mode="after")
    def _adapters_need_lora(self) -> TrainerConfig:
        if self.publish == "adapter" and not self.lora.enabled:
            raise ValueError(
                "publish = 'adapter' needs LoRA training: set trainer.lora.enabled = true "
                "(or publish = 'merged')"
            )
        if self.scope == "tenant" and not self.publishes_adapters:
            raise ValueError(
                "trainer.scope = 'tenant' trains one LoRA adapter per tenant: set "
                "trainer.lora.enabled = true and leave trainer.publish unset or 'adapter' "
                "(or set trainer.scope = 'shared')"
            )
        return self

    @property
    def tenant_scope(self) -> bool:
        """True when each tenant's adapter learns from that tenant's turns alone."""
        return self.scope == "tenant"

    @property
    def steps_per_batch(self) -> int:
        """Optimizer steps one batch makes: `tenant_minibatches` in tenant scope (if set),
        else `minibatches`."""
        if self.tenant_scope and self.tenant_minibatches is not None:
            return self.tenant_minibatches
        return self.minibatches

    @property
    def publishes_adapters(self) -> bool:
        """True when versions are published as LoRA adapters (not full weights)."""
        return self.lora.enabled and self.publish != "merged"
