"""The engine contract: what every `EngineClient` must do, run against every engine.

`torch` is the embedded engine on tiny-random (part of `make test`); `sglang` is the
gateway in front of two real SGLang servers on smollm2-135m (`make test-sglang`). The
tests only use the interface, so they hold for any model.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from liveloop.config import SGLangConfig
from liveloop.models import load_model, resolve_model_dir
from liveloop.server.engine import (
    ContextLengthError,
    EngineClient,
    InvalidRequestError,
    SamplingParams,
    TokenOutput,
)
from liveloop.server.tools import ChatTemplate, parse_tool_calls
from liveloop.server.tools.spec import OutputSpec, ToolSpec
from liveloop.weights import CheckpointError
from tests.support.sglang import MODEL as SGLANG_MODEL

pytest_plugins = ["tests.sglang_fixtures"]

ENGINES = ["torch", pytest.param("sglang", marks=pytest.mark.sglang)]
MODELS = {"torch": "tiny-random", "sglang": SGLANG_MODEL}


@pytest.fixture(params=ENGINES)
async def engine(request: pytest.FixtureRequest) -> AsyncIterator[EngineClient]:
    """A started engine of each kind."""
    if request.param == "torch":
        from liveloop.server.engine import TorchEngine

        loaded = load_model("tiny-random")
        eng: EngineClient = TorchEngine(loaded.model, loaded.tokenizer, max_batch_size=4)
    else:
        from liveloop.server.engine.sglang import SGLangEngine

        urls = request.getfixturevalue("sglang_urls")
        eng = SGLangEngine(SGLANG_MODEL, SGLangConfig(urls=urls, health_interval_s=0.5))
    await eng.start()
    yield eng
    await eng.stop()


def model_of(engine: EngineClient) -> str:
    return MODELS[engine.kind]


def prompt_ids(engine: EngineClient, text: str = "Tell me about the sea.") -> list[int]:
    return ChatTemplate(engine.tokenizer).render_ids([{"role": "user", "content": text}], None)


async def run(
    engine: EngineClient, prompt: list[int], params: SamplingParams, affinity: str = "s"
) -> list[TokenOutput]:
    return [t async for t in engine.generate(prompt, params, affinity=affinity)]


def greedy(max_tokens: int = 6, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)  # type: ignore[arg-type]


def repeatable(engine: EngineClient, **kw: object) -> SamplingParams:
    """Parameters that give the same tokens twice and varied text on this engine's model.

    Seeded sampling on the torch engine (tiny-random's greedy text is all newlines);
    greedy on SGLang, which honours `seed` only with `--enable-deterministic-inference`,
    a mode its CPU backend does not have.
    """
    if engine.kind == "torch":
        return SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True, **kw)  # type: ignore[arg-type]
    return greedy(8, **kw)


async def test_tokens_carry_ids_logprobs_versions_and_one_finish(engine: EngineClient) -> None:
    out = await run(engine, prompt_ids(engine), greedy(6))
    assert len(out) == 6
    assert [t.finish_reason for t in out] == [None] * 5 + ["length"]
    assert all(0 <= t.token_id < engine.vocab_size for t in out)
    assert all(t.logprob <= 0.0 for t in out)
    assert {t.version for t in out} == {engine.version}
    assert engine.num_running == 0


async def test_greedy_decoding_repeats(engine: EngineClient) -> None:
    prompt = prompt_ids(engine)
    first, second = [await run(engine, prompt, greedy(5)) for _ in range(2)]
    assert [t.token_id for t in first] == [t.token_id for t in second]
    for a, b in zip(first, second, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


async def test_top_logprobs_rank_the_greedy_token_first(engine: EngineClient) -> None:
    out = await run(engine, prompt_ids(engine), greedy(4, top_logprobs=3))
    for t in out:
        assert len(t.top_logprobs) == 3
        values = [lp for _, lp in t.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert t.top_logprobs[0][0] == t.token_id
        assert abs(t.top_logprobs[0][1] - t.logprob) < 1e-4


async def test_stop_token_ids_and_stop_strings(engine: EngineClient) -> None:
    prompt = prompt_ids(engine)
    ids = [t.token_id for t in await run(engine, prompt, repeatable(engine))]
    by_id = await run(engine, prompt, repeatable(engine, stop_token_ids=[ids[2]]))
    cut = ids.index(ids[2]) + 1
    assert [t.token_id for t in by_id] == ids[:cut] and by_id[-1].finish_reason == "stop"

    def text(n: int) -> str:
        return str(engine.tokenizer.decode(ids[:n], skip_special_tokens=True))

    end = next((n for n in range(3, 9) if len(text(n)) >= 2), None)
    assert end is not None, f"sampled text too short for a stop string: {text(8)!r}"
    stop = text(end)[-2:]
    cut = next(n for n in range(1, 9) if stop in text(n))
    by_string = await run(engine, prompt, repeatable(engine, stop=[stop]))
    assert by_string[-1].finish_reason == "stop" and by_string[-1].stop_string == stop
    assert [t.token_id for t in by_string] == ids[:cut]


async def test_json_schema_grammar(engine: EngineClient) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    grammar = OutputSpec(kind="json", schema=schema)
    engine.check_grammar(grammar)
    params = SamplingParams(max_tokens=40, temperature=0.0, grammar=grammar)
    out = await run(engine, prompt_ids(engine, "Is the sea blue? Answer in JSON."), params)
    assert out[-1].finish_reason == "stop"
    text = engine.tokenizer.decode([t.token_id for t in out], skip_special_tokens=True)
    assert isinstance(json.loads(text)["ok"], bool)


async def test_tool_call_grammar(engine: EngineClient) -> None:
    tool = ToolSpec(
        "get_weather", "", {"type": "object", "properties": {"city": {"type": "string"}}}
    )
    grammar = OutputSpec(kind="tool_calls", tools=[tool], single_call=True)
    params = SamplingParams(max_tokens=60, temperature=0.0, grammar=grammar)
    out = await run(engine, prompt_ids(engine, "Weather in Paris?"), params)
    text = engine.tokenizer.decode([t.token_id for t in out], skip_special_tokens=True)
    _content, calls = parse_tool_calls(text)
    assert out[-1].finish_reason == "stop"
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


async def test_closing_a_stream_cancels_the_request(engine: EngineClient) -> None:
    stream = engine.generate(prompt_ids(engine), greedy(400))
    for _ in range(2):
        await anext(stream)
    assert engine.num_running == 1
    await stream.aclose()
    assert engine.num_running == 0
    assert len(await run(engine, prompt_ids(engine), greedy(2))) == 2  # still serving


async def test_bad_input_is_refused_before_anything_runs(engine: EngineClient) -> None:
    with pytest.raises(InvalidRequestError):
        engine.generate([1, engine.vocab_size], greedy(2))
    with pytest.raises(ContextLengthError):
        engine.generate([1] * engine.max_model_len, greedy(2))
    assert engine.num_running == 0


def perturbed_checkpoint(model: str, target: Path, scale: float) -> Path:
    """A full model directory whose norm weights are scaled (a new policy version)."""
    source = resolve_model_dir(model)
    shutil.copytree(source, target)
    weights = load_file(str(source / "model.safetensors"))
    scaled = {k: v * scale if "norm" in k else v for k, v in weights.items()}
    save_file(scaled, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


async def test_weight_updates_change_logprobs_and_roll_back_exactly(
    engine: EngineClient, tmp_path: Path
) -> None:
    prompt = prompt_ids(engine)
    before = await run(engine, prompt, greedy(3))
    await engine.load_weights(str(perturbed_checkpoint(model_of(engine), tmp_path / "v1", 1.5)), 1)
    assert engine.version == 1
    after = await run(engine, prompt, greedy(3))
    assert {t.version for t in after} == {1}
    assert after[0].logprob != pytest.approx(before[0].logprob, abs=1e-3)
    await engine.load_weights(str(resolve_model_dir(model_of(engine))), 0)  # roll back
    again = await run(engine, prompt, greedy(3))
    assert [t.token_id for t in again] == [t.token_id for t in before]
    for a, b in zip(again, before, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert a.version == 0


async def test_unusable_checkpoints_are_refused_and_serving_goes_on(
    engine: EngineClient, tmp_path: Path
) -> None:
    corrupt = perturbed_checkpoint(model_of(engine), tmp_path / "corrupt", 1.0)
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file" * 10)
    nan = perturbed_checkpoint(model_of(engine), tmp_path / "nan", float("nan"))
    serving = engine.version
    for bad in (corrupt, nan, tmp_path / "missing"):
        with pytest.raises(CheckpointError):
            await engine.load_weights(str(bad), serving + 1)
    assert engine.version == serving and engine.is_running
    assert len(await run(engine, prompt_ids(engine), greedy(2))) == 2
