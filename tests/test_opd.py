"""On-policy distillation: enhanced prompts, OPD advantages and their gradient, the teacher
signal of a batch under its budgets, and one OPD update on the real tiny-random model."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from liveloop.config.opd import OPDSettings
from liveloop.config.trainer import LoraSettings, TrainerConfig
from liveloop.contracts import BatchSample, SampleHint
from liveloop.server.prompting import PromptBuilder
from liveloop.server.sessions import PreviousTurn
from liveloop.server.tools.template import ChatTemplate
from liveloop.trainer.loss import (
    AdvantageConfig,
    LossConfig,
    decoupled_ppo_loss,
    opd_term,
    token_advantages,
)
from liveloop.trainer.opd.distill import Distiller, make_teacher
from liveloop.trainer.opd.prompts import HintInserter
from liveloop.trainer.policy import Policy, completion_logprobs, load_policy
from liveloop.trainer.ppo import PPOUpdater
from tests.test_trainer import policy

HINT = "Shorter, please: 8 words at most."
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def pol() -> Policy:
    return policy()


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


@pytest.mark.parametrize("role", ["user", "system"])
@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]])
def test_enhanced_prompt_is_a_fresh_render_with_the_hint_inserted(
    pol: Policy, role: str, tools: list[dict[str, Any]] | None
) -> None:
    template = ChatTemplate(pol.tokenizer)
    inserter = HintInserter(pol.tokenizer, role=role, template_text="Note: {hint}")
    messages = [{"role": "system", "content": "Be kind."}, user("Tell me about bees.")]
    prompt = template.render_ids(messages, tools)
    enhanced = inserter.insert(prompt, messages, tools, HINT)
    hinted = [*messages, {"role": role, "content": f"Note: {HINT}"}]
    assert enhanced.failure is None
    assert enhanced.ids == template.render_ids(hinted, tools)
    # The recorded prompt is untouched before the insertion point and after it.
    assert enhanced.ids is not None and enhanced.ids[-3:] == prompt[-3:]


def test_enhanced_prompt_of_an_extended_follow_up_turn(pol: Policy) -> None:
    """A follow-up prompt is previous prompt + sampled completion + new ids, never re-rendered:
    the hint goes in before the new assistant header, and everything sampled stays as it was."""
    template = ChatTemplate(pol.tokenizer)
    builder = PromptBuilder(template, pol.tokenizer)
    first = [user("Tell me about bees.")]
    first_ids = template.render_ids(first, None)
    sampled = pol.tokenizer.encode(" Bees make honey and live in hives.", add_special_tokens=False)
    end = pol.tokenizer.convert_tokens_to_ids("<|im_end|>")
    completion = [*sampled, end]
    reply = pol.tokenizer.decode(sampled)
    follow_up = [*first, {"role": "assistant", "content": reply}, user("And owls?")]
    previous = PreviousTurn(
        session_id="s",
        turn_index=0,
        sample_index=0,
        prompt_token_ids=first_ids,
        completion_token_ids=completion,
    )
    built = builder.build(follow_up, None, previous)
    assert built.mode == "extended"
    enhanced = HintInserter(pol.tokenizer).insert(built.token_ids, follow_up, None, HINT)
    assert enhanced.ids is not None
    head = len(first_ids) + len(completion)
    assert enhanced.ids[:head] == built.token_ids[:head]
    hinted = template.render_text([*follow_up, {"role": "system", "content": HINT}], None)
    assert HintInserter(pol.tokenizer).decode(enhanced.ids) == hinted


def test_no_enhanced_prompt_when_it_cannot_be_exact(pol: Policy) -> None:
    template = ChatTemplate(pol.tokenizer)
    messages = [user("Tell me about bees.")]
    prompt = template.render_ids(messages, None)
    inserter = HintInserter(pol.tokenizer)
    other = template.render_ids([user("Tell me about owls.")], None)
    assert inserter.insert(other, messages, None, HINT).failure == "mismatch"
    assert inserter.insert(prompt[:-1], messages, None, HINT).failure == "mismatch"

    class Strict:  # a template that refuses two user messages in a row, as some do
        chat_template = (
            "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == "
            "messages[loop.index0 - 1]['role'] %}{{ raise_exception('roles must alternate') }}"
            "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        )

        def __getattr__(self, name: str) -> Any:
            return getattr(pol.tokenizer, name)

    strict = HintInserter(Strict(), role="user")
    assert strict.insert(prompt, messages, None, HINT).failure == "template"
    lenient = HintInserter(Strict(), role="system")  # a system message there is allowed
    own = lenient.template.render_ids(messages, None)
    assert lenient.insert(own, messages, None, HINT).ids
    assert lenient.insert(prompt, messages, None, HINT).failure == "mismatch"  # other template


def test_opd_advantage_and_its_gradient_by_hand() -> None:
    teacher = torch.tensor([-1.0, -3.0, -0.5, -2.0])
    proximal = torch.tensor([-2.0, -1.0, -0.5, -9.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])  # the last token's turn has no teacher signal
    scalar = torch.tensor([0.5, 0.5, 0.5, -1.0])
    opd = AdvantageConfig("opd", opd_weight=1.0, opd_clip=1.5)
    got = token_advantages(scalar, opd_term(teacher, proximal, mask, opd), opd)
    assert got.tolist() == [1.0, -1.5, 0.0, 0.0]
    combine = AdvantageConfig("combine", rl_weight=0.5, opd_weight=2.0, opd_clip=None)
    expected = [0.25 + 2.0, 0.25 - 4.0, 0.25, -0.5]
    combined = token_advantages(scalar, opd_term(teacher, proximal, mask, combine), combine)
    assert combined.tolist() == expected
    rl = AdvantageConfig("rl")
    assert token_advantages(scalar, None, rl).tolist() == scalar.tolist()
    with pytest.raises(ValueError, match="OPD term"):
        token_advantages(scalar, None, combine)

    # At current = proximal (ratio 1, inside the clip range) and behaviour = proximal (w = 1)
    # the loss is -sum(A_t * ratio_t) and d loss / d current_t = -A_t.
    current = proximal.clone().requires_grad_(True)
    advantages = token_advantages(scalar, opd_term(teacher, proximal, mask, combine), combine)
    terms = decoupled_ppo_loss(current, proximal, proximal, advantages, LossConfig())
    assert float(terms.loss_sum.detach()) == pytest.approx(-sum(expected))
    terms.loss_sum.backward()
    assert current.grad is not None
    assert current.grad.tolist() == pytest.approx([-a for a in expected])
    # Above the clip range a positive advantage no longer pulls: its gradient is 0 there.
    high = (proximal + torch.tensor([0.5, 0.0, 0.0, 0.0])).requires_grad_(True)
    decoupled_ppo_loss(high, proximal, proximal, advantages, LossConfig()).loss_sum.backward()
    assert high.grad is not None and high.grad.tolist() == pytest.approx([0.0, 3.75, -0.25, 0.5])


def test_centred_opd_advantages_have_a_zero_mean_per_reply() -> None:
    # Two replies (3 and 2 tokens); the second's last token has no teacher signal.
    teacher = torch.tensor([-1.0, -2.0, -3.0, -1.0, -5.0])
    proximal = torch.tensor([-0.5, -0.5, -0.5, -2.0, -1.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    scalar = torch.zeros(5)
    # Uncentred: the teacher finds reply 1 less likely everywhere, so every token is pushed down.
    plain = AdvantageConfig("opd", opd_clip=None)
    assert token_advantages(scalar, opd_term(teacher, proximal, mask, plain), plain).tolist() == [
        -0.5, -1.5, -2.5, 1.0, 0.0,
    ]  # fmt: skip
    centred = AdvantageConfig("opd", opd_clip=None, opd_center=True)
    got = token_advantages(scalar, opd_term(teacher, proximal, mask, centred, [3, 2]), centred)
    assert got.tolist() == pytest.approx([1.0, 0.0, -1.0, 0.0, 0.0])  # reply 1 mean -1.5
    with pytest.raises(ValueError, match="length"):
        opd_term(teacher, proximal, mask, centred)


def hinted_samples(pol: Policy, n: int = 4, hint: bool = True) -> list[BatchSample]:
    template = ChatTemplate(pol.tokenizer)
    out = []
    for i in range(n):
        messages = [user(f"Tell me about topic number {i}.")]
        prompt = template.render_ids(messages, None)
        completion = pol.tokenizer.encode(
            f" Topic {i} is a long story that goes on and on for a while.",
            add_special_tokens=False,
        )
        out.append(
            BatchSample(
                key=f"k{i}",
                prompt_token_ids=prompt,
                completion_token_ids=completion,
                logprobs=[-10.8] * len(completion),
                versions=[0] * len(completion),
                advantage=-0.5,
                score=-1.0,
                hint=SampleHint(text=HINT, messages=messages) if hint else None,
            )
        )
    return out


def test_policy_teacher_scores_the_completion_after_the_hinted_prompt(pol: Policy) -> None:
    cfg = OPDSettings(hint_role="system")
    distiller = Distiller(cfg, pol, make_teacher(cfg, pol, 256, "cpu", "tiny-random"))
    samples = [*hinted_samples(pol, 3), *hinted_samples(pol, 1, hint=False)]
    samples[-1].key = "plain"
    signal = distiller.signal(samples)
    assert signal.hinted == 3 and set(signal.logprobs) == {"k0", "k1", "k2"}
    assert not signal.skipped and signal.seconds > 0
    template = ChatTemplate(pol.tokenizer)
    for sample in samples[:3]:
        assert sample.hint is not None
        hinted = [*sample.hint.messages, {"role": "system", "content": HINT}]
        fresh = BatchSample(
            **{**sample.model_dump(), "prompt_token_ids": template.render_ids(hinted, None)}
        )
        from liveloop.trainer.data import build_micro_batch

        with torch.no_grad():
            direct = completion_logprobs(pol.model, build_micro_batch([fresh]))[0]
        assert signal.logprobs[sample.key] == pytest.approx(direct.tolist(), abs=1e-4)
        plain = completion_logprobs(pol.model, build_micro_batch([sample]))[0]
        assert not torch.allclose(direct, plain)  # the hint changed what the teacher expects


def test_budgets_leave_turns_out_and_count_them(pol: Policy) -> None:
    samples = hinted_samples(pol, 3)
    tight = OPDSettings(max_turn_tokens=16)
    signal = Distiller(tight, pol, make_teacher(tight, pol, 256, "cpu", "x")).signal(samples)
    assert signal.logprobs == {} and signal.skipped == {"too_long": 3}
    hurried = OPDSettings(batch_time_budget_s=1e-9)
    # one sample per micro-batch: the deadline passes before the first one
    signal = Distiller(hurried, pol, make_teacher(hurried, pol, 16, "cpu", "x")).signal(samples)
    assert signal.logprobs == {} and signal.skipped == {"time_budget": 3}


@pytest.mark.parametrize("objective", ["opd", "combine"])
def test_an_opd_update_moves_the_student_towards_the_teacher(objective: str) -> None:
    """The reference weights told the hint teach a student that has drifted from them: one
    small step brings the student's log-probs of the taught tokens closer to the teacher's."""
    pol = load_policy("tiny-random", "cpu", LoraSettings(), with_reference=True)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in pol.model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    opd = OPDSettings(teacher="reference")
    cfg = TrainerConfig(lr=1e-4, objective=objective, kl_coef=0.0, opd=opd)  # type: ignore[arg-type]
    updater = PPOUpdater(pol, cfg, model_name="tiny-random")
    samples = [*hinted_samples(pol, 3), *hinted_samples(pol, 1, hint=False)]
    samples[-1].key = "plain"
    stats = updater.update(samples)
    assert stats.hinted == 3 and stats.opd_samples == 3 and stats.hint_share == 0.75
    assert stats.opd_gap_before > 0.1 and stats.opd_gap_after is not None
    assert stats.opd_gap_after < stats.opd_gap_before
    assert stats.opd_seconds > 0 and math.isfinite(stats.opd_advantage)
    metrics = stats.as_metrics()
    assert metrics["hint_share"] == 0.75 and "opd_gap_after" in metrics
    assert "opd: 3/3 hinted taught" in stats.describe()


def test_rl_objective_ignores_hints() -> None:
    pol = policy()
    updater = PPOUpdater(pol, TrainerConfig(lr=1e-3), model_name="tiny-random")
    stats = updater.update(hinted_samples(pol, 2))
    assert updater.distiller is None
    assert stats.hinted == 2 and stats.opd_samples == 0 and stats.opd_gap_after is None
    assert stats.describe().endswith("; 2 hinted")  # the trainer's log line: nothing taught
