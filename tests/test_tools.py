"""Tool calling and structured output: chat rendering, tool-call parsing (batch and streaming),
and grammar-constrained decoding driven by the real tiny-random model."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from liveloop.models import LoadedModel, load_model
from liveloop.server.tools import (
    ChatTemplate,
    StreamingToolCallParser,
    TokenConstraintFactory,
    ToolRequestError,
    build_constraint,
    parse_tool_calls,
)

WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"type": "string", "maxLength": 6},
    },
    "required": ["city", "days"],
}
TIME_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"tz": {"type": "string", "maxLength": 5}, "dst": {"type": "boolean"}},
    "required": ["tz"],
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Forecast.",
            "parameters": WEATHER_PARAMS,
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
REPORT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "score": {"type": "integer", "minimum": -5, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
    },
    "required": ["ok", "score", "tags"],
}
USER: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


def schema_errors(value: Any, schema: dict[str, Any], path: str = "$") -> list[str]:
    """A small JSON-schema validator for the keywords these tests use (closed objects)."""
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    kind = schema.get("type")
    if kind == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "number":
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    else:
        ok = kind is None or isinstance(value, kinds[kind])
    if not ok:
        return [f"{path}: {value!r} is not {kind}"]
    errors = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} not in {schema['enum']}")
    if "minimum" in schema and value < schema["minimum"]:
        errors.append(f"{path}: {value} < {schema['minimum']}")
    if "maximum" in schema and value > schema["maximum"]:
        errors.append(f"{path}: {value} > {schema['maximum']}")
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        errors.append(f"{path}: longer than {schema['maxLength']}")
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        errors.append(f"{path}: more than {schema['maxItems']} items")
    for i, item in enumerate(value if kind == "array" else []):
        errors += schema_errors(item, schema.get("items", {}), f"{path}[{i}]")
    if kind == "object":
        props = schema.get("properties", {})
        errors += [f"{path}: missing {k}" for k in schema.get("required", []) if k not in value]
        errors += [f"{path}: unexpected {k}" for k in value if k not in props]
        for key in set(value) & set(props):
            errors += schema_errors(value[key], props[key], f"{path}.{key}")
    return errors


def generate(tiny: LoadedModel, prompt: list[int], constraint: Any, seed: int | None) -> list[int]:
    """A minimal decode loop: forward, mask with the constraint, greedy or seeded sampling."""
    vocab = tiny.model.config.vocab_size
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    out: list[int] = []
    inputs, past = torch.tensor([prompt]), None
    with torch.no_grad():
        for _ in range(400):
            result = tiny.model(input_ids=inputs, past_key_values=past, use_cache=True)
            past = result.past_key_values
            mask = constraint.allowed_token_mask(vocab)
            assert mask.dtype == torch.bool and mask.shape == (vocab,)
            logits = result.logits[0, -1].masked_fill(~mask, float("-inf"))
            if gen is None:
                token = int(logits.argmax())
            else:
                token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            constraint.accept_token(token)
            out.append(token)
            if constraint.is_terminated():
                return out
            inputs = torch.tensor([[token]])
    raise AssertionError(f"no termination within 400 tokens: {tiny.tokenizer.decode(out)!r}")


def completion_text(tiny: LoadedModel, ids: list[int]) -> str:
    """Decoded completion without its final end-of-sequence token (which must be there)."""
    assert ids[-1] == tiny.tokenizer.eos_token_id
    assert tiny.tokenizer.eos_token_id not in ids[:-1]
    return str(tiny.tokenizer.decode(ids[:-1]))


def accepts(tiny: LoadedModel, factory: TokenConstraintFactory, text: str) -> bool:
    """Whether the constraint lets this exact text through and then allows only end-of-sequence."""
    constraint = factory.new()
    vocab = tiny.model.config.vocab_size
    eos = tiny.tokenizer.eos_token_id
    for token in tiny.tokenizer(text, add_special_tokens=False)["input_ids"]:
        mask = constraint.allowed_token_mask(vocab)
        assert bool(mask[eos]) == constraint.is_complete(), "end-of-sequence iff complete"
        if not mask[token]:
            return False
        constraint.accept_token(token)
    mask = constraint.allowed_token_mask(vocab)
    if not mask[eos]:
        return False
    constraint.accept_token(eos)
    return constraint.is_terminated()


# ---------------------------------------------------------------- rendering


def test_render_without_tools_matches_the_template(tiny: LoadedModel) -> None:
    template = ChatTemplate(tiny.tokenizer)
    messages = [{"role": "system", "content": "Be brief."}, *USER]
    expected = tiny.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert not template.supports_tools
    assert template.render_text(messages, None) == expected
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, *USER]
    assert template.render_text(parts, None) == expected
    assert template.render_ids(messages, None) == list(
        tiny.tokenizer(expected, add_special_tokens=False)["input_ids"]
    )
    assert not template.render_text(messages, None, add_generation_prompt=False).endswith(
        "assistant\n"
    )


def test_render_with_tools_injects_a_system_section(tiny: LoadedModel) -> None:
    template = ChatTemplate(tiny.tokenizer)
    text = template.render_text(USER, TOOLS)
    assert text.startswith("<|im_start|>system\n# Available functions")
    assert "SmolLM" not in text  # the tools section replaces the default system prompt
    assert json.dumps(TOOLS[0]["function"]["parameters"]) in text
    assert '"name": "get_time"' in text and "<tool_call>" in text
    with_system = template.render_text([{"role": "system", "content": "Be brief."}, *USER], TOOLS)
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\n# Available functions")
    assert with_system.count("<|im_start|>system") == 1


def test_render_tool_calls_and_results_in_history(tiny: LoadedModel) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
    }
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
    ]
    text = ChatTemplate(tiny.tokenizer).render_text(messages, TOOLS)
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call><|im_end|>\n'
        '<|im_start|>tool\n<tool_response name="get_weather" id="call_1">\nsunny\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    ) in text


def test_constrained_call_rerenders_to_the_sampled_text(tiny: LoadedModel) -> None:
    """The next turn's prompt continues the previous prompt + completion text exactly."""
    template = ChatTemplate(tiny.tokenizer)
    factory = build_constraint(
        tiny.tokenizer, tools=TOOLS, tool_choice="required", response_format=None
    )
    assert factory is not None
    prompt = template.render_text(USER, TOOLS)
    ids = generate(tiny, template.render_ids(USER, TOOLS), factory.new(), seed=3)
    content, calls = parse_tool_calls(completion_text(tiny, ids))
    history = [*USER, {"role": "assistant", "content": content, "tool_calls": calls}]
    rerendered = template.render_text(history, TOOLS, add_generation_prompt=False)
    assert rerendered.startswith(prompt + str(tiny.tokenizer.decode(ids)))


def test_tool_aware_template_gets_tools_and_argument_objects(tiny: LoadedModel) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny.path))
    tokenizer.chat_template = (
        "{{ tools | tojson }}|{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<{{ c.function.name }} {{ c.function.arguments.city }}>{% endfor %}"
        "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %};{% endfor %}"
    )
    template = ChatTemplate(tokenizer)
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    messages = [
        *USER,
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ]
    text = template.render_text(messages, TOOLS, add_generation_prompt=False)
    assert template.supports_tools
    assert text.split("|")[0] == json.dumps(TOOLS)
    assert text.endswith(
        "|user:What is the weather in Paris?;assistant:<get_weather Oslo>;tool:rain[c1];"
    )


def test_render_rejects_non_text_parts(tiny: LoadedModel) -> None:
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ToolRequestError) as info:
        ChatTemplate(tiny.tokenizer).render_text(bad, None)
    assert info.value.param == "messages" and "image_url" in str(info.value)


# ---------------------------------------------------------------- parsing

CALL_A = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
)
CALL_B = '<tool_call>{"name":"get_time","arguments":"{\\"tz\\": \\"UTC\\"}"}</tool_call>'
TEXTS = [
    CALL_A,
    f"Let me check.\n{CALL_A}\n{CALL_B}\n",
    f"{CALL_A} then {CALL_B} done  ",
    "<tool_call>{not json}</tool_call> and <tool_call> hi",
    "plain text, no calls <tool_ but a near miss <tool_call",
    f"  {CALL_A}",
    '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}',  # closing tag missing at the end
    "",
    "   \n",
]


def test_parse_single_and_several_calls() -> None:
    content, calls = parse_tool_calls(CALL_A)
    assert content is None
    assert [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}
    ]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    content, calls = parse_tool_calls(TEXTS[1])
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"tz": "UTC"}
    assert len({c["id"] for c in calls}) == 2
    content, _ = parse_tool_calls(TEXTS[2])
    assert content == "then\ndone  "


def test_parse_malformed_and_absent_calls_stay_content() -> None:
    assert parse_tool_calls(TEXTS[3]) == (TEXTS[3], [])
    assert parse_tool_calls(TEXTS[4]) == (TEXTS[4], [])
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": [1]}</tool_call>')[1] == []
    assert parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>')[1] == []
    content, calls = parse_tool_calls(TEXTS[6])
    assert content is None and calls[0]["function"] == {
        "name": "get_time",
        "arguments": '{"tz": "CET"}',
    }


def _stream(chunks: list[str]) -> tuple[str, list[tuple[int, str, str]]]:
    parser = StreamingToolCallParser()
    deltas = [d for chunk in chunks for d in parser.feed(chunk)] + parser.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls = []
    for delta in deltas:
        assert set(delta) <= {"content", "tool_calls"}
        for call in delta.get("tool_calls", []):
            assert call["id"].startswith("call_") and call["type"] == "function"
            calls.append((call["index"], call["function"]["name"], call["function"]["arguments"]))
    return content, calls


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_matches_batch_at_every_split(text: str) -> None:
    content, calls = parse_tool_calls(text)
    expected = (
        content or "",
        [(i, c["function"]["name"], c["function"]["arguments"]) for i, c in enumerate(calls)],
    )
    rng = random.Random(len(text))
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    splits.append(list(text))  # one character at a time
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    for chunks in splits:
        assert _stream(chunks) == expected, chunks


def test_streaming_holds_back_a_possible_tag_then_releases_it() -> None:
    parser = StreamingToolCallParser()
    assert parser.feed("Hi <tool") == [{"content": "Hi"}]
    assert parser.feed("box> ok") == [{"content": " <toolbox> ok"}]
    assert parser.feed(CALL_A)[0]["tool_calls"][0]["index"] == 0
    assert parser.finish() == []


# ---------------------------------------------------------------- grammar


def test_tool_grammar_accepts_valid_calls_only(tiny: LoadedModel) -> None:
    factory = build_constraint(
        tiny.tokenizer, tools=TOOLS, tool_choice="required", response_format=None
    )
    assert factory is not None and factory.kind == "tool_calls"
    time_call = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    assert accepts(tiny, factory, CALL_A)
    assert accepts(tiny, factory, f"{CALL_A}\n{time_call}")
    assert not accepts(tiny, factory, "")
    assert not accepts(tiny, factory, "Sure. " + CALL_A)
    assert not accepts(tiny, factory, CALL_A.replace("get_weather", "get_wetter"))
    assert not accepts(tiny, factory, CALL_A.replace('"days": 3', '"days": 30'))
    assert not accepts(tiny, factory, CALL_A.replace(', "days": 3', ""))
    assert not accepts(tiny, factory, time_call.replace('"UTC"', '"UTC", "x": 1'))
    assert not accepts(tiny, factory, time_call.replace('"UTC"', '"U\tC"'))  # raw control character
    assert not accepts(tiny, factory, time_call.replace('"UTC"', '"UTC+01:00"'))  # over maxLength
    single = build_constraint(
        tiny.tokenizer,
        tools=TOOLS,
        tool_choice="required",
        response_format=None,
        parallel_tool_calls=False,
    )
    assert single is not None
    assert accepts(tiny, single, time_call)
    assert not accepts(tiny, single, f"{CALL_A}\n{time_call}")
    named = build_constraint(
        tiny.tokenizer,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        response_format=None,
    )
    assert named is not None
    assert accepts(tiny, named, time_call)
    assert not accepts(tiny, named, CALL_A)
    assert not accepts(tiny, named, f"{time_call}\n{time_call}")


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_random_model_makes_valid_required_calls(tiny: LoadedModel, seed: int | None) -> None:
    factory = build_constraint(
        tiny.tokenizer, tools=TOOLS, tool_choice="required", response_format=None
    )
    assert factory is not None
    ids = generate(tiny, ChatTemplate(tiny.tokenizer).render_ids(USER, TOOLS), factory.new(), seed)
    text = completion_text(tiny, ids)
    content, calls = parse_tool_calls(text)
    assert content is None and calls
    for call in calls:
        arguments = json.loads(call["function"]["arguments"])
        assert schema_errors(arguments, SCHEMAS[call["function"]["name"]]) == []
    # streamed the way a server detokenizes (text grown token by token), the calls are the same
    deltas, sent = [], ""
    for end in range(1, len(ids)):
        grown = str(tiny.tokenizer.decode(ids[:end]))
        if not grown.endswith("\ufffd"):  # hold back a partly decoded character
            deltas.append(grown[len(sent) :])
            sent = grown
    assert "".join(deltas) == text
    expected = [(i, c["function"]["name"], c["function"]["arguments"]) for i, c in enumerate(calls)]
    assert _stream(deltas) == ("", expected)


def test_random_model_calls_the_named_function(tiny: LoadedModel) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    factory = build_constraint(
        tiny.tokenizer, tools=TOOLS, tool_choice=choice, response_format=None
    )
    assert factory is not None
    prompt = ChatTemplate(tiny.tokenizer).render_ids(USER, TOOLS)
    for seed in (None, 5):
        content, calls = parse_tool_calls(
            completion_text(tiny, generate(tiny, prompt, factory.new(), seed))
        )
        assert content is None and len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
        assert schema_errors(json.loads(calls[0]["function"]["arguments"]), WEATHER_PARAMS) == []


def test_random_model_writes_json_objects_and_schema_instances(tiny: LoadedModel) -> None:
    prompt = ChatTemplate(tiny.tokenizer).render_ids(USER, None)
    any_object = build_constraint(
        tiny.tokenizer, tools=None, tool_choice=None, response_format={"type": "json_object"}
    )
    assert any_object is not None and any_object.kind == "json"
    for seed in (None, 1):
        assert isinstance(
            json.loads(completion_text(tiny, generate(tiny, prompt, any_object.new(), seed))), dict
        )
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "report", "schema": REPORT_SCHEMA, "strict": True},
    }
    factory = build_constraint(
        tiny.tokenizer, tools=TOOLS, tool_choice="auto", response_format=response_format
    )
    assert factory is not None
    for seed in (None, 1, 2):
        value = json.loads(completion_text(tiny, generate(tiny, prompt, factory.new(), seed)))
        assert schema_errors(value, REPORT_SCHEMA) == []


def test_mask_pads_a_larger_model_vocabulary(tiny: LoadedModel) -> None:
    size = len(tiny.tokenizer) + 64
    factory = build_constraint(
        tiny.tokenizer,
        tools=None,
        tool_choice=None,
        response_format={"type": "json_object"},
        vocab_size=size,
    )
    assert factory is not None
    mask = factory.new().allowed_token_mask(size)
    assert mask.shape == (size,) and not mask[len(tiny.tokenizer) :].any()
    assert mask[tiny.tokenizer.convert_tokens_to_ids("{")]
    assert not mask[tiny.tokenizer.convert_tokens_to_ids("<|im_start|>")]


# ---------------------------------------------------------------- request errors


def test_free_decoding_needs_no_constraint(tiny: LoadedModel) -> None:
    for tools, choice, fmt in [
        (None, None, None),
        (TOOLS, "auto", None),
        (TOOLS, "none", {"type": "text"}),
        (None, "none", None),
    ]:
        assert (
            build_constraint(tiny.tokenizer, tools=tools, tool_choice=choice, response_format=fmt)
            is None
        )


def _fn(name: str, parameters: Any = None) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _schema(schema: Any, name: str | None = "r") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


BAD_RANGE = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}}


@pytest.mark.parametrize(
    ("tools", "choice", "fmt", "param", "words"),
    [
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "tool_choice", "'nope'"),
        (None, "required", None, "tool_choice", "non-empty"),
        ([], {"type": "function", "function": {"name": "get_time"}}, None, "tool_choice", "not in"),
        (TOOLS, "sometimes", None, "tool_choice", "'auto'"),
        ({"type": "function"}, "auto", None, "tools", "list"),
        ([{"type": "function", "function": {"parameters": {}}}], "required", None, "tools", "name"),
        ([_fn("f", {"type": "string"})], "required", None, "tools", "object"),
        ([TOOLS[0], TOOLS[0]], "required", None, "tools", "duplicate"),
        ([_fn("f", BAD_RANGE)], "required", None, "tools", "minimum"),
        (None, None, {"type": "xml"}, "response_format", "type"),
        (None, None, _schema({}, name=None), "response_format", "name"),
        (None, None, _schema({"type": "foo"}), "response_format", "Unsupported type"),
        (None, None, _schema({"anyOf": []}), "response_format", "no value"),
    ],
)
def test_request_errors(
    tiny: LoadedModel, tools: Any, choice: Any, fmt: Any, param: str, words: str
) -> None:
    with pytest.raises(ToolRequestError) as info:
        build_constraint(tiny.tokenizer, tools=tools, tool_choice=choice, response_format=fmt)
    assert info.value.param == param
    assert words in str(info.value)
    assert "/project/" not in str(info.value)
