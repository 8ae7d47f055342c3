"""Property tests (hypothesis) of the parsers that read what others wrote.

The tool-call parser reads arbitrary model output, the session prefix matcher arbitrary
client histories, the spool whatever a crash left on disk, and the stream decoders whatever
is in Redis. None of them may raise on such input except in the documented way, and each
keeps its stated invariant for every input hypothesis finds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from liveloop import bus
from liveloop.bus import Entry
from liveloop.contracts import (
    BatchSample,
    Feedback,
    ScoredTurn,
    TrainingBatch,
    TurnRecord,
    WeightsAnnouncement,
)
from liveloop.prm.judges.base import JudgeRequest, NextState, TurnHead
from liveloop.prm.panel import Verdict
from liveloop.prm.scorer import Job, scored_fields
from liveloop.server.sessions import (
    ServedSample,
    SessionStore,
    canonical_message,
    chain_hashes,
)
from liveloop.server.tools import StreamingToolCallParser, parse_tool_calls
from liveloop.server.tools.format import CLOSE_TAG, OPEN_TAG, format_call
from liveloop.server.traces.spool import Spool

FAST = settings(
    max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), database=None
)

# ---------------------------------------------------------------- tool-call parser

# Text made of tag fragments, JSON pieces and words: the shapes that stress the parser.
PIECES = st.sampled_from(
    [OPEN_TAG, CLOSE_TAG, "<tool", "<tool_", "</tool", "<", ">", "{", "}", '"name"', ":",
     '"f"', ",", '"arguments"', "{}", " ", "\n", "hi", "é", '{"name": "f", "arguments": {}}']
)  # fmt: skip
MODEL_TEXT = st.one_of(st.lists(PIECES, max_size=30).map("".join), st.text(max_size=80))
NAMES = st.text("abcdefgh_", min_size=1, max_size=8)
ARGS = st.dictionaries(st.text("xyz", min_size=1, max_size=3), st.integers() | st.text(max_size=5))


def _streamed(chunks: list[str], truncated: bool) -> tuple[str, list[tuple[str, str]]]:
    parser = StreamingToolCallParser()
    deltas = [d for c in chunks for d in parser.feed(c)] + parser.finish(truncated=truncated)
    content = "".join(d.get("content", "") for d in deltas)
    calls = [
        (c["function"]["name"], c["function"]["arguments"])
        for d in deltas
        for c in d.get("tool_calls", [])
    ]
    return content, calls


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


@FAST
@given(text=MODEL_TEXT, cuts=st.lists(st.integers(0, 200), max_size=6), truncated=st.booleans())
def test_tool_parser_never_raises_and_streaming_equals_batch(
    text: str, cuts: list[int], truncated: bool
) -> None:
    content, calls = parse_tool_calls(text, truncated=truncated)
    expected = (content or "", [(c["function"]["name"], c["function"]["arguments"]) for c in calls])
    assert _streamed(_split(text, cuts), truncated) == expected
    if not calls and not truncated:
        assert content == text  # text without a call comes back exactly


@FAST
@given(
    lead=st.text("abc .!\n", max_size=20),
    calls=st.lists(st.tuples(NAMES, ARGS), min_size=1, max_size=3),
    data=st.data(),
)
def test_a_truncated_call_never_leaks_markup(
    lead: str, calls: list[tuple[str, dict[str, Any]]], data: st.DataObject
) -> None:
    whole = lead + "\n".join(format_call(n, json.dumps(a)) for n, a in calls)
    cut = data.draw(st.integers(len(lead) + 1, len(whole) - 1))
    text = whole[:cut]
    content, parsed = parse_tool_calls(text, truncated=True)
    assert "<tool" not in (content or "") and "</tool" not in (content or "")
    complete = text.count(CLOSE_TAG)
    assert complete <= len(parsed) <= complete + 1  # + the last one if only its tag is cut
    for call, (name, args) in zip(parsed, calls, strict=False):
        assert call["function"]["name"] == name
        assert json.loads(call["function"]["arguments"]) == args
    assert _streamed(list(text), truncated=True)[0] == (content or "")


# ---------------------------------------------------------------- session prefix matcher

TEXT_PARTS = st.lists(st.text(max_size=8), min_size=1, max_size=3)
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool"]),
        "content": st.text(max_size=20),
    }
)


@FAST
@given(messages=st.lists(MESSAGE, max_size=8), more=st.lists(MESSAGE, max_size=4))
def test_chain_hashes_of_a_prefix_are_a_prefix(
    messages: list[dict[str, Any]], more: list[dict[str, Any]]
) -> None:
    short, long = chain_hashes(messages), chain_hashes(messages + more)
    assert long[: len(short)] == short
    assert len(set(long)) == len(long)  # every prefix has its own hash


@FAST
@given(messages=st.lists(MESSAGE, min_size=1, max_size=6), parts=TEXT_PARTS, i=st.integers(0, 5))
def test_echoed_messages_match_and_changed_ones_do_not(
    messages: list[dict[str, Any]], parts: list[str], i: int
) -> None:
    i %= len(messages)
    # what clients add when they echo a message back does not change its identity ...
    echoed = [dict(m, refusal=None, annotations=[]) for m in messages]
    as_parts = [dict(m) for m in messages]
    as_parts[i]["content"] = [{"type": "text", "text": p} for p in parts]
    plain = [dict(m) for m in messages]
    plain[i]["content"] = "".join(parts)
    assert chain_hashes(echoed) == chain_hashes(messages)
    assert chain_hashes(as_parts) == chain_hashes(plain)
    # ... but another role or other text does
    changed = [dict(m) for m in messages]
    changed[i]["content"] = messages[i]["content"] + "!"
    assert chain_hashes(changed)[i] != chain_hashes(messages)[i]
    assert canonical_message(changed[i]) != canonical_message(messages[i])


def _call_message(arguments: str, content: str | None = None) -> dict[str, Any]:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"role": "assistant", "content": content, "tool_calls": [call]}


@FAST
@given(args=ARGS, indent=st.sampled_from([None, 1, 4]))
def test_a_call_echoed_with_re_serialized_arguments_is_the_same_message(
    args: dict[str, Any], indent: int | None
) -> None:
    # the model's own layout (pretty-printed JSON) against a client's json.dumps of its dict
    served = _call_message(json.dumps(args, indent=indent))
    echoed = _call_message(json.dumps(args, ensure_ascii=False), content="")
    assert chain_hashes([served]) == chain_hashes([echoed])
    other = _call_message(json.dumps({**args, "extra": 1}))
    assert chain_hashes([other]) != chain_hashes([served])


USER_OR_TOOL = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "tool"]), "content": st.text(max_size=12)}
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    history=st.lists(MESSAGE, min_size=1, max_size=5),
    reply=st.text(max_size=12),
    extra=st.lists(USER_OR_TOOL, min_size=1, max_size=3),
)
def test_session_lookup_finds_exactly_the_served_prefix(
    redis_url: str, history: list[dict[str, Any]], reply: str, extra: list[dict[str, Any]]
) -> None:
    """The session prefix matcher, against a real Valkey: a request that extends a served
    (messages + reply) joins that turn; another tenant, another reply or another explicit
    session never does."""
    tenant, other = "t-" + uuid.uuid4().hex[:8], "t-" + uuid.uuid4().hex[:8]
    sid = "s-" + uuid.uuid4().hex[:8]
    answer = {"role": "assistant", "content": reply}

    async def check() -> None:
        client = aredis.from_url(redis_url, decode_responses=True)
        # The matching is under test, not the latency: a loaded test machine may take longer
        # than serving's 0.5 s to connect, and the store would (rightly) degrade.
        store = SessionStore(client, ttl_s=60, timeout_s=30.0)
        try:
            served = ServedSample(0, answer, [1, 2], [3, 4])
            await store.remember(tenant, sid, 4, history, [served])
            found = await store.lookup(tenant, [*history, answer, *extra], None)
            assert found is not None and (found.session_id, found.turn_index) == (sid, 4)
            assert (found.prompt_token_ids, found.completion_token_ids) == ([1, 2], [3, 4])
            assert await store.lookup(tenant, [*history, answer, *extra], sid) is not None
            assert await store.lookup(other, [*history, answer, *extra], None) is None
            assert await store.lookup(tenant, [*history, answer, *extra], "s-x") is None
            wrong = {"role": "assistant", "content": reply + "?"}
            assert await store.lookup(tenant, [*history, wrong, *extra], None) is None
        finally:
            await client.aclose()

    asyncio.run(check())


# ---------------------------------------------------------------- spool format

RECORD_LINES = st.lists(
    st.dictionaries(
        st.text("abc", max_size=3), st.integers() | st.text(max_size=6), max_size=3
    ).map(json.dumps),
    max_size=12,
)


def _replay_all(spool: Spool) -> list[bytes]:
    out: list[bytes] = []
    while batch := spool.read_batch(5):
        for line in batch:
            out.append(line.raw)
            spool.advance(line)
    spool.compact()
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    lines=RECORD_LINES,
    cut=st.integers(0, 64),
    garbage=st.binary(max_size=40),
)
def test_spool_reads_back_every_byte_after_any_torn_or_garbled_tail(
    tmp_path_factory: pytest.TempPathFactory, lines: list[str], cut: int, garbage: bytes
) -> None:
    directory = tmp_path_factory.mktemp("spool")
    first = Spool(directory)
    first.open()
    first.append(lines)
    first.close()
    path = directory / "turns.spool"
    data = path.read_bytes()
    kept = data[: max(0, len(data) - cut)]
    corrupted = kept + garbage  # a torn write, then junk
    path.write_bytes(corrupted)

    spool = Spool(directory)
    spool.open()
    expected = corrupted.split(b"\n")
    if expected[-1] == b"":
        expected.pop()
    assert spool.torn_tails == (1 if corrupted and not corrupted.endswith(b"\n") else 0)
    assert spool.backlog == len(expected)
    got = _replay_all(spool)
    assert got == expected  # every byte comes back, in order, as lines
    intact = [ln.encode() for ln in lines]
    whole = kept.count(b"\n")
    assert got[:whole] == intact[:whole]  # the records before the damage are untouched
    assert spool.backlog == 0 and path.read_bytes() == b""
    spool.close()


def test_quarantine_keeps_the_raw_bytes(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    spool.open()
    (tmp_path / "turns.spool").write_bytes(b'{"ok": 1}\n\x00\x00\xff junk\n')
    spool.close()
    spool = Spool(tmp_path)
    spool.open()
    good, bad = spool.read_batch(10)
    spool.quarantine(bad, "not JSON")
    assert good.raw == b'{"ok": 1}'
    assert spool.quarantined == 1
    assert spool.quarantine_path.read_bytes().endswith(b"\n\x00\x00\xff junk\n")
    spool.close()


# ---------------------------------------------------------------- stream payload decoders

IDS = st.lists(st.integers(0, 50_000), max_size=6)
TURNS = st.builds(
    TurnRecord,
    session_id=st.text(min_size=1, max_size=12),
    turn_index=st.integers(0, 99),
    turn_type=st.sampled_from(["main", "side"]),
    tenant=st.text(max_size=8),
    request_id=st.text(max_size=8),
    sample_index=st.integers(0, 3),
    messages=st.lists(MESSAGE, max_size=3),
    response=MESSAGE,
    prompt_token_ids=IDS,
    completion_token_ids=IDS,
    logprobs=st.lists(st.floats(-50, 0), max_size=6),
    versions=st.lists(st.integers(0, 9), max_size=6),
    finish_reason=st.sampled_from(["stop", "length", "tool_calls", "abort"]),
    model=st.text(max_size=8),
    created_at=st.floats(0, 2e9),
)
VERDICTS = st.builds(
    Verdict,
    score=st.floats(-1, 1),
    judge=st.text(max_size=6),
    step_scores=st.none() | st.lists(st.floats(-1, 1), max_size=3),
    hint=st.none() | st.text(max_size=10),
    votes=st.none() | st.lists(st.floats(-1, 1), max_size=3),
)
PAYLOADS = st.one_of(
    TURNS,
    st.builds(Feedback, session_id=st.text(max_size=8), turn_index=st.integers(0, 9),
              score=st.floats(-1, 1), tenant=st.text(max_size=5), comment=st.none() | st.text()),
    st.builds(WeightsAnnouncement, version=st.integers(0, 10**6), path=st.text(max_size=20),
              parent=st.none() | st.integers(0, 10)),
    st.builds(TrainingBatch, batch_id=st.text(max_size=8), trainer_version=st.integers(0, 9),
              num_tokens=st.integers(0, 999), samples=st.none() | st.lists(st.builds(
                  BatchSample, key=st.text(max_size=6), prompt_token_ids=IDS,
                  completion_token_ids=IDS, logprobs=st.lists(st.floats(-9, 0), max_size=4),
                  versions=st.lists(st.integers(0, 5), max_size=4), advantage=st.floats(-5, 5),
                  score=st.floats(-1, 1)), max_size=2)),
)  # fmt: skip
ANY_FIELDS = st.dictionaries(
    st.sampled_from(["data", "keys", "next", "feedback", "x"]),
    st.one_of(st.text(max_size=30), st.sampled_from(["{}", "[]", "null", '["a"]', '[{"r": 1}]'])),
)


@FAST
@given(payload=PAYLOADS)
def test_every_contract_round_trips_through_stream_fields(payload: Any) -> None:
    fields = bus.encode(payload, session_id="s", turn_index=1)
    assert bus.decode(fields, type(payload)) == payload
    assert bus.decode({k.encode(): v.encode() for k, v in fields.items()}, type(payload)) == payload


@FAST
@given(fields=ANY_FIELDS, model=st.sampled_from([TurnRecord, ScoredTurn, Feedback, TrainingBatch]))
def test_decoders_raise_only_value_errors_on_arbitrary_fields(
    fields: dict[str, str], model: Any
) -> None:
    for decode in (lambda: bus.decode(fields, model), lambda: Job.parse(Entry("1-0", fields))):
        with contextlib.suppress(ValueError):  # ValidationError, JSONDecodeError are ValueErrors
            decode()


@FAST
@given(turn=TURNS, verdict=VERDICTS, signal=st.sampled_from(["next_turn", "feedback", "timeout"]))
def test_scored_fields_fast_path_decodes_to_the_turn_and_its_verdict(
    turn: TurnRecord, verdict: Verdict, signal: str
) -> None:
    raw = turn.model_dump_json()
    head = TurnHead.model_validate_json(raw)
    state = NextState(
        messages=[] if signal == "next_turn" else None,
        feedback=Feedback(session_id="s", turn_index=0, score=0.5, tenant="t")
        if signal == "feedback"
        else None,
    )
    request = JudgeRequest(head.messages, head.response, state, raw=raw)
    scored = bus.decode(scored_fields(request, head, raw, verdict), ScoredTurn)
    assert (
        TurnRecord.model_validate(scored.model_dump(include=set(TurnRecord.model_fields))) == turn
    )
    assert (scored.score, scored.judge, scored.signal) == (verdict.score, verdict.judge, signal)
    assert (scored.hint, scored.votes, scored.step_scores) == (
        verdict.hint,
        verdict.votes,
        verdict.step_scores,
    )


def test_value_errors_include_validation_errors() -> None:
    assert issubclass(ValidationError, ValueError)
