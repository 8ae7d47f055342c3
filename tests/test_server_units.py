"""Server building blocks without HTTP: message hashing, sessions on a real Valkey,
token-exact prompt extension, stop-string hold-back, API-key tenancy."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis.asyncio as aredis

from liveloop.server.api.auth import Authenticator, tenant_id
from liveloop.server.api.chat.sample import SampleState, TokenText
from liveloop.server.api.errors import APIError
from liveloop.server.engine import TokenOutput
from liveloop.server.prompting import PromptBuilder
from liveloop.server.sessions import (
    PreviousTurn,
    ServedSample,
    SessionForbidden,
    SessionStore,
    chain_hashes,
)
from liveloop.server.tools import ChatTemplate
from liveloop.valkey import free_port
from tests.server_proc import model_dir


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir()))


def test_chain_hash_ignores_what_clients_add_when_echoing() -> None:
    ours = {"role": "assistant", "content": "hi", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ]}  # fmt: skip
    echoed = {**ours, "refusal": None, "annotations": [], "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ]}  # fmt: skip
    user = {"role": "user", "content": [{"type": "text", "text": "q"}]}
    assert chain_hashes([user, ours]) == chain_hashes([user, echoed])
    assert chain_hashes([user, ours])[0] == chain_hashes([user])[0]
    assert (
        chain_hashes([user, {"role": "assistant", "content": "hi!"}])[1]
        != chain_hashes([user, ours])[1]
    )


async def test_session_store_on_valkey(aredis_client: aredis.Redis) -> None:
    store = SessionStore(aredis_client, ttl_s=60)
    first = await store.allocate("t1", None)
    again = await store.allocate("t1", first.session_id)
    assert (first.turn_index, again.turn_index) == (0, 1)
    with pytest.raises(SessionForbidden):
        await store.allocate("t2", first.session_id)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    reply = {"role": "assistant", "content": "yo"}
    await store.remember("t1", first.session_id, 1, messages, [ServedSample(0, reply, [1, 2], [3])])
    follow: list[dict[str, Any]] = [
        *messages,
        {**reply, "refusal": None},
        {"role": "user", "content": "more"},
    ]
    previous = await store.lookup("t1", follow, None)
    assert previous == PreviousTurn(first.session_id, 1, 0, [1, 2], [3], reply_index=1)
    assert await store.lookup("t2", follow, None) is None  # other tenants never match
    assert await store.lookup("t1", follow, "another-session") is None
    assert await store.owner(first.session_id) == ("t1", 2)


async def test_session_store_degrades_without_redis() -> None:
    client = aredis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.2)
    store = SessionStore(client, ttl_s=60)
    started = time.monotonic()
    turns = [await store.allocate("t", "s1") for _ in range(3)]
    assert [t.turn_index for t in turns] == [0, 1, 2]
    assert await store.lookup("t", [{"role": "assistant", "content": "x"}], None) is None
    assert time.monotonic() - started < 2.0
    await client.aclose()


async def test_turns_given_out_during_an_outage_are_not_reused(aredis_client: aredis.Redis) -> None:
    store = SessionStore(aredis_client, ttl_s=60)
    assert (await store.allocate("t", "s2")).turn_index == 0
    store._down_until = time.monotonic() + 60  # Redis "unreachable": local counters
    assert [(await store.allocate("t", "s2")).turn_index for _ in range(2)] == [1, 2]
    store._down_until = 0.0  # back: Redis knows only turn 0, yet 1 and 2 are taken
    assert (await store.allocate("t", "s2")).turn_index == 3
    assert (await store.allocate("t", "s2")).turn_index == 4


def test_prompt_extends_previous_ids_when_the_template_agrees(tokenizer: Any) -> None:
    template = ChatTemplate(tokenizer)
    builder = PromptBuilder(template, tokenizer)
    first: list[dict[str, Any]] = [{"role": "user", "content": "Hi"}]
    prompt = builder.build(first, None, None)
    assert prompt.mode == "fresh" and prompt.token_ids == template.render_ids(first, None)
    eos = tokenizer.eos_token_id
    completion = [*tokenizer.encode(" Hello there", add_special_tokens=False), eos]
    previous = PreviousTurn("s", 0, 0, prompt.token_ids, completion)
    follow = [
        *first,
        {"role": "assistant", "content": " Hello there"},
        {"role": "user", "content": "Bye"},
    ]
    extended = builder.build(follow, None, previous)
    assert extended.mode == "extended"
    assert (
        extended.token_ids[: len(prompt.token_ids) + len(completion)]
        == prompt.token_ids + completion
    )
    assert builder.decode(extended.token_ids) == template.render_text(follow, None)
    edited = [
        *first,
        {"role": "assistant", "content": " Hello, there"},
        {"role": "user", "content": "Bye"},
    ]
    assert builder.build(edited, None, previous).mode == "fresh"


def test_stop_string_text_is_never_sent(tokenizer: Any) -> None:
    text_ids = tokenizer.encode("alpha beta STOP gamma", add_special_tokens=False)
    sample = SampleState(0, TokenText(tokenizer), ["STOP", "xy"], True, time.perf_counter())
    sent = ""
    for i, token in enumerate(text_ids):
        done = tokenizer.decode(text_ids[: i + 1]).find("STOP") >= 0
        sample.add(
            TokenOutput(token, -0.5, 0, [], "stop" if done else None, "STOP" if done else None)
        )
        sent += sample.take_text()
        if done:
            break
    assert sent == sample.text == "alpha beta "
    assert sample.finish_reason == "stop"
    assert len(sample.take_logprobs()) == len(sample.token_ids)


def test_api_keys_map_to_tenants() -> None:
    auth = Authenticator(["k1", "k2"], admin_key="adm")
    assert auth.tenant("k2") == tenant_id("k2") != "k2"
    for bad in (None, "k3"):
        with pytest.raises(APIError) as err:
            auth.tenant(bad)
        assert err.value.status == 401
    auth.check_admin("adm")
    with pytest.raises(APIError):
        auth.check_admin("k1")
    open_auth = Authenticator([], admin_key=None)
    assert open_auth.open and open_auth.tenant(None) == "anonymous"
    with pytest.raises(APIError) as err:
        open_auth.check_admin("anything")
    assert err.value.status == 403


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_a_follow_up_to_a_call_keeps_the_call_as_the_model_sampled_it(tokenizer: Any) -> None:
    """The client sends the call back as `tool_calls`, which the template writes in its own
    form; the follow-up's prompt still holds the model's own sampled call (a fenced JSON
    object here), then the tool result as a fresh render would write it."""
    template = ChatTemplate(tokenizer)
    builder = PromptBuilder(template, tokenizer)
    tools = [WEATHER_TOOL]
    ask: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo?"}]
    prompt = builder.build(ask, tools, None)
    sampled = '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```'
    completion = [*tokenizer.encode(sampled, add_special_tokens=False), tokenizer.eos_token_id]
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    follow = [
        *ask,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "Oslo: snow, -3 C"},
    ]
    previous = PreviousTurn("s", 0, 0, prompt.token_ids, completion)
    built = builder.build(follow, tools, previous)
    assert built.mode == "extended"
    served = len(prompt.token_ids) + len(completion)
    assert built.token_ids[:served] == prompt.token_ids + completion
    fresh = template.render_text(follow, tools)
    through = template.render_text(follow[:2], tools, add_generation_prompt=False)
    assert sampled not in fresh  # a fresh render would show the template's form of the call
    assert builder.decode(built.token_ids[served:]) == "\n" + fresh[len(through) :]
    cut_off = PreviousTurn("s", 0, 0, prompt.token_ids, completion[:-1])  # hit max_tokens
    assert builder.build(follow, tools, cut_off).mode == "fresh"
    no_result_yet = follow[:2]  # nothing after the call: nothing to extend with
    assert builder.build(no_result_yet, tools, previous).mode == "fresh"

    # A reply the server did not serve came after the served call (another client's, say):
    # the served sample is still the one extended, and nothing after it is left out.
    call2 = {**call, "id": "c2", "function": {**call["function"], "arguments": '{"city": "Lima"}'}}
    later = [
        *follow,
        {"role": "assistant", "content": None, "tool_calls": [call2]},
        {"role": "tool", "tool_call_id": "c2", "content": "Lima: sun"},
    ]
    found = PreviousTurn("s", 0, 0, prompt.token_ids, completion, reply_index=1)
    text = builder.decode(builder.build(later, tools, found).token_ids)
    assert text.startswith(builder.decode(prompt.token_ids + completion))
    assert "Oslo: snow, -3 C" in text and "Lima: sun" in text


def test_a_later_turn_keeps_a_call_sampled_turns_before(tokenizer: Any) -> None:
    """After the call, its result and a text answer, the next user message extends the
    answer's prompt, which holds the call as the model wrote it; a client that sends the
    answer back changed gets a fresh render."""
    template = ChatTemplate(tokenizer)
    builder = PromptBuilder(template, tokenizer)
    tools = [WEATHER_TOOL]
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    ask: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo?"}]
    sampled = '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```'
    first = PreviousTurn(
        "s", 0, 0, builder.build(ask, tools, None).token_ids,
        [*tokenizer.encode(sampled, add_special_tokens=False), tokenizer.eos_token_id],
    )  # fmt: skip
    after_result = [
        *ask,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "Oslo: snow, -3 C"},
    ]
    second = builder.build(after_result, tools, first)
    answer = "It snows in Oslo."
    answered = PreviousTurn(
        "s", 1, 0, second.token_ids,
        [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id],
        reply_index=3,
    )  # fmt: skip
    thanks: list[dict[str, Any]] = [
        *after_result,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Thanks! And Lima?"},
    ]
    third = builder.build(thanks, tools, answered)
    assert third.mode == "extended"
    served = answered.prompt_token_ids + answered.completion_token_ids
    assert third.token_ids[: len(served)] == served and sampled in builder.decode(third.token_ids)
    assert builder.decode(third.token_ids).endswith(
        template.render_text(thanks, tools)[len(template.render_text(thanks[:4], tools, False)) :]
    )
    edited = [*thanks[:3], {"role": "assistant", "content": "It rains."}, thanks[4]]
    assert builder.build(edited, tools, answered).mode == "fresh"
