"""Defaults that depend on the model, for the built-in aliases (and a fallback for others).

The KL coefficient anchors the policy to its reference model. Too small and a policy that
pleases its judge drifts into unnatural text; too large and it cannot learn at all.
How the values were set: tiny-random's reference is random noise, so its anchor is only
nominal (0.001: nothing to protect, and its 3-minute demo must still learn). For
smollm2-135m, 0.1 was compared with 0.03 in two 15-minute demos (learning rate 1e-4, one
run each): 0.03 gained a little more reward (+0.59 against +0.48, within the run-to-run
spread), but the gate refused 2 of its 9 versions (0.1: none), and its served replies named
the topic less often (58-69% against version 0's 78%; with 0.1, 53-83% against 65%) and were
more often no answer (up to 12%; with 0.1, 3-7%). 0.1 stays: it keeps quality for about the
same reward.

The demo's objective: on smollm2-135m (`bench/learning.py`, seed 0, 192 judged turns,
learning rate 5e-5) 'rl' had all 11 versions accepted by the promotion gate, while
'combine' lost the topic in its first update (probe replies naming the topic: 79% -> 43%)
and had most versions refused, with the teacher being the policy or the reference and
with OPD advantages centred or not. A 135M model reading "please be brief" as an extra
message does not become a better teacher, so smollm2's demo learns from the reward alone;
`--objective combine` still runs it. Three seeds later (160 judged turns, threshold -0.4)
said the same: 'rl' reached it in 2 of 3 seeds, 'combine' in 1 of 3, with held-out topic
rates of 62-71% against 33-62%. With the OPD advantage at a quarter of the reward's weight
(`trainer.opd.opd_weight` 0.25; 3 seeds, 160 judged turns, paced at 16) 'combine' still
never reached -0.4: gain -0.08 +- 0.23, held-out replies naming the topic 42%, most versions
refused by the gate for losing the topic. Under LoRA (rank 16, 1e-3: the demo's environment;
3 seeds, 160 judged turns, paced at 16, threshold -0.4) the same again: 'rl' gained +0.27 +-
0.05 and reached it in 1 of 3 seeds, held-out topic 82%; 'combine' gained -0.15 +- 0.13,
never reached it, held-out topic 54%, and only 4-5 of its 10 versions served traffic against
6-10 of 'rl''s (OPD took 13 s of a 35 s update). tiny-random has no language to lose and keeps
'combine', though there too 'rl' learned faster (3 seeds, 400 judged turns: 'rl' reached a
moving reward of 0.25 in all three, after 323 +- 80 turns; 'combine' in one of three).

Demo pacing: free-running users on a 2-core machine made ~1450 judged turns in 15 minutes
of which the trainer learned from ~240, while serving them took a core from the trainer.
smollm2's demo users wait for the trainer at 24 judged turns per version, and its trainer
gets two threads (`liveloop.demo.run.DEMO_ENV`): two 15-minute runs made 13 updates each
instead of 11 and gained +0.47 each (held-out users -0.79 -> -0.08 and -0.58 -> -0.33),
against +0.38 for the last free-running run (+0.00 to +0.59 before). Its demo now trains
LoRA adapters (rank 16) at 1e-3 (`DEMO_ENV`): two runs gained +0.72 each with all quality
checks kept, against +0.27 and +0.31 for full fine-tuning at 1e-4 the same day. Under
LoRA, KL 0.05 gained +0.75 and 0.02 gained +0.64 (one run each, every quality check kept,
3 versions refused in each), against +0.67 to +0.72 in four runs at 0.1: no gain worth
less anchoring, so 0.1 stays. With the faster trainer of late November (versions every
~29 s), pacing at 16 turns per version instead of 24 (the watch's `min_turns` lowered to 16
with it) made 36 versions instead of 28-35 but only 580 judged turns instead of 693-815,
and gained +0.45 (every check kept, 3 refused), against +0.16 to +1.11 (median +0.81) in
seven runs at 24 the same days: no reason to change (one run).
"""

from __future__ import annotations

from dataclasses import dataclass

from liveloop.config.base import Objective


@dataclass(frozen=True)
class ModelDefaults:
    """What a model's defaults are: KL anchor, reply budget and the users it suits."""

    kl_coef: float
    gate_max_kl: float | None  # the promotion gate's bound on KL to the reference (None: none)
    reply_tokens: int  # completion budget of demo users and gate probes
    word_limits: tuple[int, ...]  # word limits of simulated users
    has_language: bool  # False for a random model: users then judge only their preference
    demo_objective: Objective  # what `liveloop demo` trains with unless told otherwise
    demo_turns_per_update: int = 0  # demo users paced at this many judged turns per version


BUILTIN: dict[str, ModelDefaults] = {
    # A random model starts at ~11 words in 16 tokens and has no language to protect.
    # Drifting from a random reference is no harm: no KL bound at the gate.
    "tiny-random": ModelDefaults(
        0.001, None, 16, (6, 8, 10), has_language=False, demo_objective="combine"
    ),
    # SmolLM2 starts at ~37 words in 48 tokens.
    # Hints do not help a 135M teacher (see above): its demo learns from the reward alone.
    # Its demo users are paced at 24 judged turns per version (see the module's docstring).
    "smollm2-135m": ModelDefaults(
        0.1,
        1.0,
        48,
        (20, 25, 30),
        has_language=True,
        demo_objective="rl",
        demo_turns_per_update=24,
    ),
    # Qwen2.5-Coder instruct models: no demo has run on them yet. Real language to protect,
    # so smollm2's anchor and gate bound. Asked the demo's topic questions (greedy, 16
    # topics), both said ~41 words in the first 48 tokens and ended on their own after
    # 60-95+ tokens: smollm2's budget and word limits give them the same room to learn
    # brevity, and a longer budget costs decode time on models 4-11 times smollm2's size.
    # (`demo_objective` only because the dataclass still requires it.)
    "qwen2.5-coder-0.5b": ModelDefaults(
        kl_coef=0.1,
        gate_max_kl=1.0,
        reply_tokens=48,
        word_limits=(20, 25, 30),
        has_language=True,
        demo_objective="rl",
    ),
    "qwen2.5-coder-1.5b": ModelDefaults(
        kl_coef=0.1,
        gate_max_kl=1.0,
        reply_tokens=48,
        word_limits=(20, 25, 30),
        has_language=True,
        demo_objective="rl",
    ),
}
# Any other model's demo runs with smollm2's environment (`DEMO_ENV`), pacing included.
FALLBACK = ModelDefaults(
    0.1, 1.0, 64, (20, 25, 30), has_language=True, demo_objective="rl", demo_turns_per_update=24
)


def model_defaults(model: str) -> ModelDefaults:
    """The defaults of a built-in alias, or the fallback for any other model."""
    return BUILTIN.get(model, FALLBACK)
