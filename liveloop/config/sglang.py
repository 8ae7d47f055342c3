"""Settings of the SGLang engine (`server.engine = "sglang"`): the gateway and its replicas."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from liveloop.config.base import Section

# The linear layers of a Llama-family decoder layer.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class SGLangConfig(Section):
    """Where the SGLang servers are (or how to launch them) and how the gateway drives them."""

    urls: list[str] = Field(
        default_factory=list,
        description="Base URLs of running SGLang servers (http://host:port), one per replica. "
        "A comma-separated string is accepted too (CLI `--sglang-url URL[,URL...]`).",
    )
    launch: int = Field(
        0,
        ge=0,
        le=64,
        description="Start this many local SGLang servers (`--launch N`; needs the "
        "`liveloop[sglang]` extra) and add them to `urls`; they stop with the server and a "
        "dead one is restarted.",
    )
    device: str = Field(
        "cuda",
        description="Device of launched servers: 'cuda' (default) or 'cpu' (then SGLang's CPU "
        "engine with torch_native attention, float32 and sleep-on-idle).",
    )
    python: str | None = Field(
        None,
        description="Python interpreter that has `sglang` installed, for launched servers "
        "(default: the one running LiveLoop).",
    )
    launch_args: list[str] = Field(
        default_factory=list,
        description="Extra command-line arguments for launched servers "
        "(e.g. ['--max-total-tokens', '32768', '--tp', '2']).",
    )
    launch_env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment variables for launched servers (e.g. CUDA_VISIBLE_DEVICES; "
        "a list per replica is not supported: use `launch_args`).",
    )
    launch_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Port of the first launched server (the next ones follow); default: free ports.",
    )
    launch_timeout_s: float = Field(
        900.0, gt=0, description="How long a launched server may take to become healthy."
    )
    pause_mode: Literal["retract", "in_place", "abort"] = Field(
        "retract",
        description="How a replica pauses for a weight update: 'retract' (in-flight requests "
        "are held and re-prefilled on the new weights after the update), 'in_place' (held with "
        "their KV cache; the cache is not flushed), 'abort' (they end at once and the gateway "
        "continues them on another replica from the tokens they had).",
    )
    health_interval_s: float = Field(
        2.0, gt=0, description="Seconds between two health checks of each replica."
    )
    health_timeout_s: float = Field(
        5.0, gt=0, description="A health check slower than this counts as a failure."
    )
    health_failures: int = Field(
        3,
        ge=1,
        description="Consecutive failed health checks (timeouts, 5xx) before a replica leaves "
        "the pool; a refused connection removes it at once.",
    )
    request_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Longest wait for the next chunk of a generation stream before the "
        "replica is considered stuck.",
    )
    update_timeout_s: float = Field(
        600.0, gt=0, description="Longest wait for one replica's update_weights_from_disk."
    )
    retry_backoff_s: tuple[float, float] = Field(
        (5.0, 300.0),
        description="First and longest wait before retrying a replica whose weight update "
        "failed (doubling in between).",
    )
    resume_attempts: int = Field(
        2,
        ge=0,
        description="How many times a request cut off by a dead or aborting replica is "
        "continued on another one from the tokens it already has (requests with a "
        "grammar or stop strings are continued only before their first token).",
    )
    path_map: dict[str, str] = Field(
        default_factory=dict,
        description="Checkpoint path prefixes as the trainer writes them -> as the SGLang "
        "servers see them (containers mounting the shared volume elsewhere); the longest "
        "matching prefix is replaced.",
    )
    check_checkpoints: bool = Field(
        True,
        description="Validate a checkpoint here before any replica loads it: files, tensor "
        "names and shapes against the served model, and no NaN/inf (SGLang 0.5 crashes on "
        "an unreadable checkpoint). Needs the checkpoint visible at its path on this host.",
    )

    enable_lora: bool = Field(
        False,
        description="Serve LoRA adapters through SGLang's multi-LoRA: launched servers get "
        "`--enable-lora` and the limits below; servers of `urls` must have been started "
        "with the same flags. Each adapter version is loaded as `<adapter>@v<N>`.",
    )
    max_loras_per_batch: int = Field(
        8,
        ge=1,
        description="Adapters one batch of a server may mix (`--max-loras-per-batch`; the "
        "base model counts as one).",
    )
    max_lora_rank: int = Field(
        64,
        ge=1,
        description="Largest adapter rank the servers accept (`--max-lora-rank`); the gateway "
        "refuses a larger one before any server sees it.",
    )
    lora_target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS),
        description="Linear layers adapters may change (`--lora-target-modules`); the gateway "
        "refuses an adapter that touches another one.",
    )
    lora_backend: str | None = Field(
        None,
        description="SGLang's multi-LoRA kernels (`--lora-backend`) for launched servers; "
        "default: 'torch_native' on CPU, SGLang's own choice on GPUs.",
    )

    @field_validator("urls", mode="before")
    @classmethod
    def _split_urls(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("urls")
    @classmethod
    def _check_urls(cls, value: list[str]) -> list[str]:
        for url in value:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r} is not an http(s) URL")
        return [url.rstrip("/") for url in value]
