"""On-policy distillation: enhanced prompts, OPD advantages and their gradient, the teacher
signal of a batch under its budgets, and one OPD update on the real tiny-random model."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from liveloop.config import ConfigError, load_settings
from liveloop.config.opd import OPDSettings
from liveloop.config.trainer import LoraSettings, TrainerConfig
from liveloop.contracts import BatchSample, SampleHint
from liveloop.server.prompting import PromptBuilder
from liveloop.server.sessions import PreviousTurn
from liveloop.server.tools.template import ChatTemplate
from liveloop.trainer.data import build_micro_batch
from liveloop.trainer.loss import LossConfig, decoupled_ppo_loss
from liveloop.trainer.objectives import ObjectiveContext, TokenInputs
from liveloop.trainer.objectives.combine import combined_advantages
from liveloop.trainer.objectives.opd import distillation_advantages
from liveloop.trainer.objectives.rl import RLObjective
from liveloop.trainer.opd.distill import Distiller, make_teacher
from liveloop.trainer.opd.prompts import HintInserter
from liveloop.trainer.policy import Policy, completion_logprobs, load_policy
from liveloop.trainer.ppo import PPOUpdater
from tests.test_collector_support import settings_for, trainer_of
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


def first_turn(prompt: list[int], completion: list[int]) -> PreviousTurn:
    """A session's first served turn, as the server remembers it for the follow-up."""
    return PreviousTurn(
        session_id="s",
        turn_index=0,
        sample_index=0,
        prompt_token_ids=prompt,
        completion_token_ids=completion,
    )


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
    previous = first_turn(first_ids, completion)
    built = builder.build(follow_up, None, previous)
    assert built.mode == "extended"
    enhanced = HintInserter(pol.tokenizer).insert(built.token_ids, follow_up, None, HINT)
    assert enhanced.ids is not None
    head = len(first_ids) + len(completion)
    assert enhanced.ids[:head] == built.token_ids[:head]
    hinted = template.render_text([*follow_up, {"role": "system", "content": HINT}], None)
    assert HintInserter(pol.tokenizer).decode(enhanced.ids) == hinted


def test_enhanced_prompt_after_a_call_the_model_wrote_its_own_way(pol: Policy) -> None:
    """A reply the server turned into tool_calls stays in the follow-up prompt as the model
    wrote it (a fenced JSON object), not as the template writes calls: the prompt is not the
    messages' fresh render, yet the hint still goes in after the tool's result (a repeated
    call's hint, say), and the sampled call stays as it was."""
    template = ChatTemplate(pol.tokenizer)
    builder = PromptBuilder(template, pol.tokenizer)
    tools = [WEATHER_TOOL]
    first = [user("Weather in Oslo?")]
    first_ids = template.render_ids(first, tools)
    written = '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```'
    end = pol.tokenizer.convert_tokens_to_ids("<|im_end|>")
    completion = [*pol.tokenizer.encode(written, add_special_tokens=False), end]
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    follow_up = [
        *first,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "Oslo: snow, -3 C"},
    ]
    previous = first_turn(first_ids, completion)
    built = builder.build(follow_up, tools, previous)
    assert built.mode == "extended"
    inserter = HintInserter(pol.tokenizer)
    assert inserter.decode(built.token_ids) != template.render_text(follow_up, tools)
    enhanced = inserter.insert(built.token_ids, follow_up, tools, HINT)
    assert enhanced.failure is None and enhanced.ids is not None
    head = len(first_ids) + len(completion)
    assert enhanced.ids[:head] == built.token_ids[:head]  # the call as sampled
    hinted = template.render_text([*follow_up, {"role": "system", "content": HINT}], tools)
    through = template.render_text(follow_up[:2], tools, add_generation_prompt=False)
    assert inserter.decode(enhanced.ids).endswith(hinted[len(through) :])
    # Another conversation's tail is still a mismatch.
    other = [*follow_up[:2], {"role": "tool", "tool_call_id": "c1", "content": "Lima: 17 C"}]
    assert inserter.insert(built.token_ids, other, tools, HINT).failure == "mismatch"


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


def tokens_of(
    teacher: torch.Tensor,
    proximal: torch.Tensor,
    mask: torch.Tensor,
    scalar: torch.Tensor,
    lengths: list[int] | None = None,
) -> TokenInputs:
    return TokenInputs(scalar, proximal, teacher, mask, lengths or [len(scalar)])


def test_opd_advantage_and_its_gradient_by_hand() -> None:
    teacher = torch.tensor([-1.0, -3.0, -0.5, -2.0])
    proximal = torch.tensor([-2.0, -1.0, -0.5, -9.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])  # the last token's turn has no teacher signal
    scalar = torch.tensor([0.5, 0.5, 0.5, -1.0])
    tokens = tokens_of(teacher, proximal, mask, scalar)
    got = distillation_advantages(tokens, OPDSettings(opd_weight=1.0, advantage_clip=1.5))
    assert got.tolist() == [1.0, -1.5, 0.0, 0.0]
    combine = OPDSettings(rl_weight=0.5, opd_weight=2.0, advantage_clip=None)
    expected = [0.25 + 2.0, 0.25 - 4.0, 0.25, -0.5]
    combined = combined_advantages(tokens, combine)
    assert combined.tolist() == expected
    no_policy: Any = None  # the reward-only objective never touches the policy
    rl = RLObjective(ObjectiveContext(no_policy, TrainerConfig(), "x")).advantages(tokens)
    assert rl.tolist() == scalar.tolist()

    # At current = proximal (ratio 1, inside the clip range) and behaviour = proximal (w = 1)
    # the loss is -sum(A_t * ratio_t) and d loss / d current_t = -A_t.
    current = proximal.clone().requires_grad_(True)
    advantages = combined_advantages(tokens, combine)
    loss_cfg = LossConfig.of(TrainerConfig())
    terms = decoupled_ppo_loss(current, proximal, proximal, advantages, loss_cfg)
    assert float(terms.loss_sum.detach()) == pytest.approx(-sum(expected))
    terms.loss_sum.backward()
    assert current.grad is not None
    assert current.grad.tolist() == pytest.approx([-a for a in expected])
    # Above the clip range a positive advantage no longer pulls: its gradient is 0 there.
    high = (proximal + torch.tensor([0.5, 0.0, 0.0, 0.0])).requires_grad_(True)
    decoupled_ppo_loss(high, proximal, proximal, advantages, loss_cfg).loss_sum.backward()
    assert high.grad is not None and high.grad.tolist() == pytest.approx([0.0, 3.75, -0.25, 0.5])


def test_centred_opd_advantages_have_a_zero_mean_per_reply() -> None:
    # Two replies (3 and 2 tokens); the second's last token has no teacher signal.
    teacher = torch.tensor([-1.0, -2.0, -3.0, -1.0, -5.0])
    proximal = torch.tensor([-0.5, -0.5, -0.5, -2.0, -1.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    tokens = tokens_of(teacher, proximal, mask, torch.zeros(5), [3, 2])
    # Uncentred: the teacher finds reply 1 less likely everywhere, so every token is pushed down.
    plain = OPDSettings(advantage_clip=None)
    assert distillation_advantages(tokens, plain).tolist() == [-0.5, -1.5, -2.5, 1.0, 0.0]
    centred = OPDSettings(advantage_clip=None, center_advantages=True)
    got = distillation_advantages(tokens, centred)
    assert got.tolist() == pytest.approx([1.0, 0.0, -1.0, 0.0, 0.0])  # reply 1 mean -1.5


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
    opd = stats.objective.metrics
    assert stats.hinted == 3 and opd["opd_samples"] == 3 and stats.hint_share == 0.75
    assert opd["opd_gap_before"] > 0.1 and "opd_gap_after" in opd
    assert opd["opd_gap_after"] < opd["opd_gap_before"]
    assert opd["opd_seconds"] > 0 and math.isfinite(opd["opd_advantage"])
    metrics = stats.as_metrics()
    assert metrics["hint_share"] == 0.75 and "opd_gap_after" in metrics
    assert "opd: 3/3 hinted taught" in stats.describe()


def test_rl_objective_ignores_hints() -> None:
    pol = policy()
    updater = PPOUpdater(pol, TrainerConfig(lr=1e-3), model_name="tiny-random")
    stats = updater.update(hinted_samples(pol, 2))
    assert isinstance(updater.objective, RLObjective)
    assert stats.hinted == 2 and "opd_samples" not in stats.objective.metrics
    assert "opd_gap_after" not in stats.as_metrics()
    assert stats.describe().endswith("; 2 hinted")  # the trainer's log line: nothing taught


def test_contrastive_advantage_and_its_gradient_by_hand() -> None:
    """log pi_T(a|s+hint) - log pi_T(a|s) is prepared before the update; the proximal
    log-probs play no part in it, and the loss pulls each token by its contrast."""
    hinted = torch.tensor([-1.0, -4.0, -0.5, -2.0])
    plain = torch.tensor([-2.0, -1.0, -0.5, -9.0])
    contrast = hinted - plain  # [1.0, -3.0, 0.0, 7.0]
    proximal = torch.tensor([-7.0, -0.1, -3.0, -1.0])  # far from both: must not matter
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])  # the last token's reply has no teacher signal
    scalar = torch.tensor([0.5, 0.5, 0.5, -1.0])
    tokens = tokens_of(contrast, proximal, mask, scalar)
    cfg = OPDSettings(advantage="contrastive", advantage_clip=2.0, opd_weight=1.0)
    assert distillation_advantages(tokens, cfg).tolist() == [1.0, -2.0, 0.0, 0.0]
    combine = OPDSettings(advantage="contrastive", advantage_clip=None, rl_weight=0.5)
    expected = [0.25 + 1.0, 0.25 - 3.0, 0.25, -0.5]
    advantages = combined_advantages(tokens, combine)
    assert advantages.tolist() == expected
    current = proximal.clone().requires_grad_(True)  # ratio 1, w 1: d loss / d current = -A
    terms = decoupled_ppo_loss(
        current, proximal, proximal, advantages, LossConfig.of(TrainerConfig())
    )
    terms.loss_sum.backward()
    assert current.grad is not None and current.grad.tolist() == pytest.approx(
        [-a for a in expected]
    )


def test_a_contrastive_signal_is_the_teacher_with_the_hint_minus_without(pol: Policy) -> None:
    cfg = OPDSettings(hint_role="system", advantage="contrastive")
    distiller = Distiller(cfg, pol, make_teacher(cfg, pol, 256, "cpu", "tiny-random"))
    samples = hinted_samples(pol, 2)
    signal = distiller.signal(samples)
    assert set(signal.logprobs) == {"k0", "k1"} and not signal.skipped
    plain = OPDSettings(hint_role="system")
    hinted = Distiller(plain, pol, make_teacher(plain, pol, 256, "cpu", "x")).signal(samples)
    for sample in samples:
        with torch.no_grad():
            own = completion_logprobs(pol.model, build_micro_batch([sample]))[0].tolist()
        want = [h - o for h, o in zip(hinted.logprobs[sample.key], own, strict=True)]
        assert signal.logprobs[sample.key] == pytest.approx(want, abs=1e-4)


def _other_tokenizer_model(tmp_path: Path) -> Path:
    """tiny-random with one token added to its tokenizer: the same model, other ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from liveloop.models import resolve_model_dir

    source = resolve_model_dir("tiny-random")
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    tokenizer.add_tokens(["<liveloop-extra>"])
    model = AutoModelForCausalLM.from_pretrained(str(source))
    model.resize_token_embeddings(len(tokenizer))
    out = tmp_path / "other-tokenizer"
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def test_a_teacher_model_must_share_the_students_tokenizer(tmp_path: Path) -> None:
    """Another local model as the teacher: loaded once, frozen; one with other token ids
    stops the trainer at start-up with a message naming the setting."""
    pol = policy()
    cache: dict[str, Any] = {}
    same = OPDSettings(teacher="model", teacher_model="tiny-random")
    teacher = make_teacher(same, pol, 256, "cpu", "tiny-random", cache)
    assert list(cache) == ["teacher:tiny-random:cpu"]
    frozen = cache["teacher:tiny-random:cpu"]
    assert not any(p.requires_grad for p in frozen.parameters())
    make_teacher(same, pol, 256, "cpu", "tiny-random", cache)  # loaded once: the same object
    assert cache["teacher:tiny-random:cpu"] is frozen
    signal = Distiller(same, pol, teacher).signal(hinted_samples(pol, 1))
    assert list(signal.logprobs) == ["k0"]

    other = str(_other_tokenizer_model(tmp_path))
    with pytest.raises(ConfigError, match=r"teacher_model = .*not the policy's \(vocabularies"):
        make_teacher(OPDSettings(teacher="model", teacher_model=other), pol, 256, "cpu", "x", {})
    trainer = trainer_of(settings_for("redis://127.0.0.1:1", tmp_path / "data", trainer={
        "objective": "combine", "opd": {"teacher": "model", "teacher_model": other}}))  # fmt: skip
    with pytest.raises(ConfigError, match="teacher_model"):
        trainer.setup()  # the trainer's start-up
    with pytest.raises(ConfigError, match=r"needs trainer\.opd\.teacher_model"):
        load_settings(trainer={"opd": {"teacher": "model"}})
