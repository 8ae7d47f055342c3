"""Settings of the promotion gate, which decides whether a trained version may be served."""

from typing import Literal

from pydantic import Field

from liveloop.config.base import Section
from liveloop.config.sense import SenseJudgeSettings


class GateSettings(Section):
    """A new version is served only if its replies to a fixed probe set do not regress.

    The probes are answered by the candidate (in the trainer's process, off the serving
    path), judged by the configured judges, and compared with the serving version's answers
    to the same probes; the candidate's drift from the reference model is bounded too.
    """

    enabled: bool = Field(True, description="Gate every new version before it is announced.")
    probe_source: str = Field(
        "auto",
        description="Where the probes come from: 'prompts' (trainer.gate.prompts), 'served' (a "
        "seeded sample of recently served requests, drawn again every refresh_versions "
        "versions), 'auto' ('prompts' when any are set, else 'served'), or the name of a "
        "source in the 'liveloop.probe_sources' entry points ('demo': the demo's held-out "
        "simulated users, who also react to each reply). Served requests and prompts have no "
        "next state: the gate's reward needs a judge that scores a reply alone (e.g. 'llm'); "
        "the drift and quality bounds apply either way.",
    )
    prompts: list[str] = Field(
        default_factory=list, description="Operator probe prompts (a user message each)."
    )
    served_probes: int = Field(
        16, ge=1, description="Served requests drawn as probes ('served' source)."
    )
    served_scan: int = Field(
        2000,
        ge=1,
        description="How many of the newest entries of liveloop:turns the 'served' source "
        "draws from.",
    )
    refresh_versions: int = Field(
        10,
        ge=1,
        description="A refreshing source ('served') draws a new probe set after this many "
        "candidates probed on the last (a tenant's gate: that tenant's own versions), and "
        "before every update while its last set was short of "
        "served_probes (too little traffic yet; a short set is topped up, its probes kept); "
        "version 0 and the serving version are probed on a changed set first, on its new "
        "probes only.",
    )
    second_draw: bool = Field(
        True,
        description="When the serving version is itself beyond a drift bound on a newly drawn "
        "set, draw up to served_probes more (a source that can: 'served') as a second set. Until "
        "the next draw, a candidate the first set finds beyond a drift bound answers the "
        "second set too, and the drift bounds decide on both sets together: more evidence, "
        "the same bounds, and one set's cost for a candidate within them.",
    )
    second_set_for_candidates: bool = Field(
        False,
        description="With second_draw: also draw the second set when the serving version is "
        "within the bounds, at the first candidate after a draw that the first set finds "
        "beyond a drift bound (its reward within the margins); version 0 answers it then, and "
        "from there on every such candidate is decided on both sets together. A share bound "
        "on one set of served_probes can refuse on a few replies; this looks twice before a "
        "refusal, at one more set's cost for a doubtful candidate only.",
    )
    probe_users: int = Field(
        16, ge=1, description="Held-out simulated users, one question each ('demo' source)."
    )
    seed: int = Field(10_000, description="Seed of the probe questions and of the probe sampling.")
    max_tokens: int | None = Field(
        None, ge=1, description="Reply budget of a probe (default: the model's demo budget, or 64)."
    )
    temperature: float = Field(
        1.0,
        gt=0,
        le=2,
        description="Sampling temperature of probe replies (1 keeps the KL estimate unbiased).",
    )
    reference_cache_mib: int = Field(
        512,
        ge=0,
        description="Memory (MiB, on the trainer's device) for the reference model's keys and "
        "values of the probe prompts, computed once per probe set: each probed version is "
        "then scored under the reference over its reply tokens only. A prompt beyond the "
        "budget is run with its reply each time (slower, the same log-probs); 0 keeps none. "
        "A gate's own budget: in tenant scope, each tenant's gate has one.",
    )
    reward_margin: float = Field(
        0.25,
        ge=0,
        le=2,
        description="Refuse a version whose mean probe reward is below the serving one by more.",
    )
    compare_with_version0: bool = Field(
        True,
        description="Also refuse a version whose probe reward is below version 0's by more than "
        "reward_margin. Without it, each accepted version may be a little worse than the last "
        "and the margins add up.",
    )
    max_topic_drop: float | None = Field(
        0.2,
        gt=0,
        le=1,
        description="Refuse a version whose share of probe replies naming the question's topic "
        "is below version 0's by more than this (on a model with language; a probe's topic is "
        "what its question names, or what a probe source plugin says); unset = no bound.",
    )
    max_symbol_share: float | None = Field(
        0.1,
        ge=0,
        le=1,
        description="Refuse a version with more than this share of probe replies dominated by "
        "symbols or markup (models with language only); unset = no bound.",
    )
    max_nonsense_rise: float | None = Field(
        0.2,
        gt=0,
        le=1,
        description="Refuse a version whose share of probe replies that are no answer at all "
        "(nonsense or word salad, symbols, markup, repeats) exceeds version 0's by more than "
        "this (models with language only); unset = no bound.",
    )
    loss_z: float | None = Field(
        1.645,
        gt=0,
        description="A share bound (max_topic_drop, max_nonsense_rise, max_sense_drop) refuses "
        "a version only where its answers are also worse than version 0's beyond sampling "
        "noise: of the probes where the two differ, those that got worse outnumber those that "
        "got better by more than this many standard errors (paired, McNemar; 1.645: one-sided "
        "5%); unset = the bound alone.",
    )
    sense: SenseJudgeSettings = Field(
        default_factory=SenseJudgeSettings,
        description="A judge model asked whether each probe reply answers its question "
        "sensibly (off until its base_url is set); each probed version then costs one judge "
        "request per probe.",
    )
    max_sense_drop: float | None = Field(
        0.2,
        gt=0,
        le=1,
        description="With the sense judge on: refuse a version whose share of sensible probe "
        "replies is below version 0's by more than this; unset = measured, not bounded.",
    )
    max_kl: float | None = Field(
        None,
        gt=0,
        description="Refuse a version whose KL to the reference on probe replies (nats/token, "
        "k3) exceeds this; unset = the model's default (1.0; no bound for tiny-random, whose "
        "reference is noise).",
    )
    max_nll_ratio: float | None = Field(
        1.25,
        gt=1,
        description="Refuse a version whose probe replies' reference NLL per token exceeds "
        "this multiple of version 0's; unset = no bound.",
    )
    on_reject: Literal["revert", "continue"] = Field(
        "revert",
        description="After a refusal, train on from the last accepted version ('revert') or "
        "from the refused weights ('continue').",
    )
    drop_momentum: bool = Field(
        True,
        description="On a revert, zero the optimizer's first moments (Adam's running average "
        "of gradients). Restored with the last accepted weights, they would carry the next "
        "update the way they carried the refused one, whatever its batch says.",
    )
    reject_lr_scale: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Each refusal in a row multiplies the next update's learning rate by "
        "this (1: unchanged); an accepted version restores the configured rate.",
    )
    min_lr_scale: float = Field(
        0.125, gt=0, le=1, description="The learning rate is never scaled below this fraction."
    )
