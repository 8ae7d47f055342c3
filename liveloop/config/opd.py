"""Settings of hindsight-guided on-policy distillation (OPD), part of the trainer's settings.

A judge may say what a reply should have done differently (a directive hint). OPD puts that
hint into the turn's own prompt, asks a teacher how likely each token the policy actually
sampled is under the hinted prompt, and uses log pi_teacher - log pi_proximal as each
token's advantage inside the trainer's decoupled PPO loss.
"""

from typing import Literal

from pydantic import Field, field_validator, model_validator

from liveloop.config.base import Section


class TeacherEndpoint(Section):
    """A teacher served behind an HTTP endpoint that returns prompt log-probs."""

    base_url: str | None = Field(
        None,
        description="Base URL of the teacher server: for api='completions' an OpenAI-compatible "
        "one ending in /v1 (vLLM, ...), for api='sglang' the SGLang server's root.",
    )
    api: Literal["completions", "sglang"] = Field(
        "completions",
        description="'completions': POST /completions with a token-id prompt, echo and "
        "logprobs (the OpenAI legacy API, as vLLM serves it). 'sglang': POST /generate with "
        "input_ids and return_logprob (input_token_logprobs).",
    )
    model: str | None = Field(
        None, description="Model name sent to the teacher (default: the trained model's name)."
    )
    api_key: str = Field("none", description="Bearer token for the teacher endpoint.")
    timeout_s: float = Field(60.0, gt=0, description="Timeout of one teacher request.")
    concurrency: int = Field(4, ge=1, description="Teacher requests in flight at once.")


class OPDSettings(Section):
    """How directive hints become token-level advantages (`trainer.objective` opd/combine)."""

    teacher: Literal["policy", "reference", "model", "endpoint"] = Field(
        "policy",
        description="Who scores the sampled tokens under the hinted prompt: 'policy' (the "
        "weights being trained, before the update: self-distillation), 'reference' (the frozen "
        "initial weights), 'model' (another local model, `trainer.opd.teacher_model`, loaded "
        "frozen in the trainer; it must share the policy's tokenizer) or 'endpoint' (another "
        "model served over HTTP, `trainer.opd.endpoint`).",
    )
    teacher_model: str | None = Field(
        None,
        description="The teacher for teacher = 'model': a model spec like --model's (an "
        "alias, a local Hugging Face directory or a .gguf file).",
    )
    advantage: Literal["plain", "contrastive"] = Field(
        "plain",
        description="The token advantage: 'plain', log pi_teacher(token | prompt + hint) - "
        "log pi_proximal(token | prompt); 'contrastive', log pi_teacher(token | prompt + hint) "
        "- log pi_teacher(token | prompt), the hint's own effect on the teacher (two teacher "
        "passes; with the policy as teacher the two are the same). A teacher that is another "
        "model differs from the student everywhere, not only where the hint matters: "
        "'contrastive' removes that mismatch.",
    )
    endpoint: TeacherEndpoint = Field(default_factory=TeacherEndpoint)
    rl_weight: float = Field(
        1.0, ge=0, description="Weight of the scalar-reward advantage under 'combine'."
    )
    opd_weight: float = Field(
        1.0, ge=0, description="Weight of the OPD token advantage under 'opd' and 'combine'."
    )
    advantage_clip: float | None = Field(
        5.0,
        gt=0,
        description="OPD token advantages are clamped to [-clip, clip] (nats); unset = no clamp.",
    )
    center_advantages: bool = Field(
        False,
        description="Centre each reply's OPD token advantages on their mean (a per-reply "
        "baseline): a teacher that finds the whole reply unlikely then no longer pushes down "
        "every sampled token at once. It keeps the expected gradient.",
    )
    hint_role: str = Field(
        "system",
        description="Role of the extra message the hint is rendered as, between the request "
        "and the assistant's reply ('system' or 'user').",
    )
    hint_template: str = Field(
        "{hint}", description="Text of that message; '{hint}' is replaced by the hint."
    )
    max_turn_tokens: int = Field(
        4096,
        ge=16,
        description="A hinted turn whose enhanced prompt + completion is longer than this is "
        "trained without OPD (counted as 'too_long').",
    )
    batch_time_budget_s: float = Field(
        60.0,
        gt=0,
        description="Most seconds the teacher may take per batch; hinted turns not scored by "
        "then are trained without OPD (counted as 'time_budget').",
    )
    measure_gap_after: bool = Field(
        True,
        description="After each update, recompute the student's log-probs of the hinted "
        "tokens to report the teacher-student gap after it (one no-grad forward of them).",
    )

    @field_validator("hint_template")
    @classmethod
    def _has_hint(cls, template: str) -> str:
        if "{hint}" not in template:
            raise ValueError("hint_template must contain '{hint}'")
        return template

    @model_validator(mode="after")
    def _teacher_named(self) -> "OPDSettings":
        if self.teacher == "endpoint" and not self.endpoint.base_url:
            raise ValueError("teacher = 'endpoint' needs trainer.opd.endpoint.base_url")
        if self.teacher == "model" and not self.teacher_model:
            raise ValueError("teacher = 'model' needs trainer.opd.teacher_model")
        return self
