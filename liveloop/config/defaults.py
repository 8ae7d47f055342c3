"""Defaults that depend on the model, for the built-in aliases (and a fallback for others).

The KL coefficient anchors the policy to its reference model: too small and a policy that
pleases its judge drifts into unnatural text, too large and it cannot learn at all. The
reply budget and the simulated users' word limits suit how long the model's replies are.
A random model has no language to protect: its anchor is nominal and the promotion gate
puts no bound on its KL. How the values were chosen is in docs/experiments.md; a demo's
tuning (learning rate, adapters, pacing, objective) is in its preset
(`liveloop/config/presets/`), not here.
"""

from __future__ import annotations

from dataclasses import dataclass

# What a model that calls a tool again instead of answering from its result is told after
# the result (`{name}`: the tool's name). The rule judge's hint for a repeated call says
# the same, so a distillation teacher sees what a served prompt may already hold.
ANSWER_FROM_RESULT = (
    "The tool already returned its result. Answer the user in words from it; do not call "
    "{name} again."
)


@dataclass(frozen=True)
class ModelDefaults:
    """What a model's defaults are: KL anchor, reply budget and the users it suits."""

    kl_coef: float
    gate_max_kl: float | None  # the promotion gate's bound on KL to the reference (None: none)
    reply_tokens: int  # completion budget of demo users and gate probes
    word_limits: tuple[int, ...]  # word limits of simulated users
    has_language: bool  # False for a random model: users then judge only their preference
    tool_result_reminder: str = ""  # a system message after tool results ("" = none)


BUILTIN: dict[str, ModelDefaults] = {
    # A random model starts at ~11 words in 16 tokens and has no language to protect.
    # Drifting from a random reference is no harm: no KL bound at the gate.
    "tiny-random": ModelDefaults(0.001, None, 16, (6, 8, 10), has_language=False),
    # SmolLM2 starts at ~37 words in 48 tokens.
    "smollm2-135m": ModelDefaults(0.1, 1.0, 48, (20, 25, 30), has_language=True),
    # Qwen2.5-Coder instruct models: real language to protect, so smollm2's anchor and gate
    # bound. Asked the demo's topic questions (greedy, 16 topics), both said ~41 words in
    # the first 48 tokens and ended on their own after 60-95+ tokens: smollm2's budget and
    # word limits give them the same room to learn brevity, and a longer budget costs
    # decode time on models 4-11 times smollm2's size.
    # Both call the tool again after nearly every result unless told not to in a system
    # message after it (then they answer from it): they get the reminder.
    "qwen2.5-coder-0.5b": ModelDefaults(
        0.1, 1.0, 48, (20, 25, 30), has_language=True, tool_result_reminder=ANSWER_FROM_RESULT
    ),
    "qwen2.5-coder-1.5b": ModelDefaults(
        0.1, 1.0, 48, (20, 25, 30), has_language=True, tool_result_reminder=ANSWER_FROM_RESULT
    ),
}
FALLBACK = ModelDefaults(0.1, 1.0, 64, (20, 25, 30), has_language=True)


def model_defaults(model: str) -> ModelDefaults:
    """The defaults of a built-in alias, or the fallback for any other model."""
    return BUILTIN.get(model, FALLBACK)
