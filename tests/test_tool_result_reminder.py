"""The tool-result reminder: a system message after each run of tool results.

A model that calls a tool again instead of answering from its result is told not to, right
after the result. The server, the promotion gate and hindsight distillation must render it
alike, or a served prompt would no longer extend token-exactly into the next turn and a
distillation teacher would be refused every turn after a tool result.
"""

from __future__ import annotations

from typing import Any

import pytest

from liveloop.config import SharedSettings
from liveloop.config.defaults import ANSWER_FROM_RESULT
from liveloop.models import load_tokenizer
from liveloop.probe_sources import Probe
from liveloop.server.prompting import PromptBuilder
from liveloop.server.sessions import PreviousTurn
from liveloop.server.tools.template import ChatTemplate, with_reminders
from liveloop.trainer.opd.prompts import HintInserter
from liveloop.trainer.safeguards.probing import render_prompts

REMINDER = "Answer from the result; do not call {name} again."
HINT = "Say the temperature."
TOOLS: Any = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    for name in ("get_weather", "get_time")
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer("tiny-random")


def call(call_id: str, name: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}


def result(call_id: str, text: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def turn(prompt: list[int], completion: list[int], index: int) -> PreviousTurn:
    return PreviousTurn(
        session_id="s",
        turn_index=index,
        sample_index=0,
        prompt_token_ids=prompt,
        completion_token_ids=completion,
    )


def test_the_reminder_follows_each_run_of_tool_results(tokenizer: Any) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather and time in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call("a", "get_weather"),
                                                            call("b", "get_time")]},
        result("a", "Oslo: snow"),
        result("b", "Oslo: 14:05"),
        {"role": "assistant", "content": "Snow, and it is 14:05."},
        {"role": "user", "content": "And Lima?"},
        {"role": "assistant", "content": "", "tool_calls": [call("c", "get_weather")]},
        result("c", "Lima: sun"),
    ]  # fmt: skip
    text = ChatTemplate(tokenizer, REMINDER).render_text(messages, TOOLS)
    both = "do not call get_weather, get_time again."
    one = "do not call get_weather again."
    assert text.count("Answer from the result") == 2
    assert text.index("Oslo: 14:05") < text.index(both) < text.index("Snow, and it is")
    assert text.index("Lima: sun") < text.index(one)
    assert text.endswith(one + "<|im_end|>\n<|im_start|>assistant\n")
    assert "Answer from the result" not in ChatTemplate(tokenizer).render_text(messages, TOOLS)
    assert len(with_reminders(messages, REMINDER)) == len(messages) + 2
    assert with_reminders(messages, "") is messages


def test_served_prompts_extend_across_the_reminder(tokenizer: Any) -> None:
    """Call, result and answer: each follow-up prompt is the previous prompt and sample plus
    the new part, with the reminder after the result, and the hint of a distillation
    teacher goes in after the reminder only where the trainer renders it too."""
    template = ChatTemplate(tokenizer, REMINDER)
    builder = PromptBuilder(template, tokenizer)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ask: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo?"}]
    prompt0 = template.render_ids(ask, TOOLS[:1])
    after_result: list[dict[str, Any]] = [
        *ask,
        {"role": "assistant", "content": None, "tool_calls": [call("a", "get_weather")]},
        result("a", "Oslo: snow, -3 C"),
    ]
    written = '```json\n{"name": "get_weather", "arguments": {}}\n```'  # not the template's way
    sample0 = [*tokenizer.encode(written, add_special_tokens=False), end]
    built1 = builder.build(after_result, TOOLS[:1], turn(prompt0, sample0, 0))
    assert built1.mode == "extended" and built1.token_ids[: len(prompt0)] == prompt0
    text1 = builder.decode(built1.token_ids)
    assert written in text1 and text1.endswith(
        "do not call get_weather again.<|im_end|>\n<|im_start|>assistant\n"
    )
    sample1 = [*tokenizer.encode("It snows, -3 C.", add_special_tokens=False), end]
    follow_up: list[dict[str, Any]] = [
        *after_result,
        {"role": "assistant", "content": "It snows, -3 C."},
        {"role": "user", "content": "Thanks!"},
    ]
    answered = turn(built1.token_ids, sample1, 1)
    answered.reply_index = 3  # where the session store found the answer
    built2 = builder.build(follow_up, TOOLS[:1], answered)
    assert built2.mode == "extended"  # the call as sampled, two turns back, is kept
    assert built2.token_ids[: len(built1.token_ids) + len(sample1)] == built1.token_ids + sample1

    enhanced = HintInserter(tokenizer, tool_result_reminder=REMINDER).insert(
        built1.token_ids, after_result, TOOLS[:1], HINT
    )
    assert enhanced.ids is not None
    assert builder.decode(enhanced.ids).endswith(
        f"again.<|im_end|>\n<|im_start|>system\n{HINT}<|im_end|>\n<|im_start|>assistant\n"
    )
    unaware = HintInserter(tokenizer).insert(built1.token_ids, after_result, TOOLS[:1], HINT)
    assert unaware.failure == "mismatch"


def test_gate_probes_render_the_reminder(tokenizer: Any) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call("a", "get_weather")]},
        result("a", "Oslo: snow"),
    ]
    probe = Probe(messages=messages, tools=TOOLS[:1])
    [ids] = render_prompts(tokenizer, [probe], REMINDER)
    assert ids == ChatTemplate(tokenizer, REMINDER).render_ids(messages, TOOLS[:1])
    assert ids != render_prompts(tokenizer, [probe])[0]


class _OtherTemplate:
    """The tiny model's tokenizer with another chat template."""

    def __init__(self, tokenizer: Any, source: str) -> None:
        self._tokenizer = tokenizer
        self.chat_template = source

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


CHATML = "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
STRICT = (  # a system message only first, as some templates demand
    "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('system messages must come first') }}{% endif %}" + CHATML + "{% endfor %}"
)
FORGETFUL = (  # system messages after the first are dropped
    "{% for m in messages %}{% if m['role'] != 'system' or loop.first %}" + CHATML
    + "{% endif %}{% endfor %}"
)  # fmt: skip


@pytest.mark.parametrize(
    ("source", "error"),
    [(STRICT, "cannot render the reminder"), (FORGETFUL, "leaves the reminder out")],
)
def test_a_template_that_cannot_hold_the_reminder_is_refused(
    tokenizer: Any, source: str, error: str
) -> None:
    other = _OtherTemplate(tokenizer, source)
    with pytest.raises(ValueError, match=error):
        ChatTemplate(other, REMINDER).check_reminder()
    ChatTemplate(other, "").check_reminder()  # no reminder, nothing to hold
    ChatTemplate(tokenizer, REMINDER).check_reminder()


def test_the_reminder_defaults_by_model() -> None:
    qwen = SharedSettings(model="qwen2.5-coder-0.5b")
    assert qwen.effective_tool_result_reminder == ANSWER_FROM_RESULT
    assert SharedSettings(model="smollm2-135m").effective_tool_result_reminder == ""
    off = SharedSettings(model="qwen2.5-coder-1.5b", tool_result_reminder="")
    assert off.effective_tool_result_reminder == ""
    own = SharedSettings(model="smollm2-135m", tool_result_reminder=REMINDER)
    assert own.effective_tool_result_reminder == REMINDER
