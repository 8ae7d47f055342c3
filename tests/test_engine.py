"""The embedded torch engine against a plain HF forward of the real tiny-random model."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator, Iterator

import pytest
import torch
from transformers import PreTrainedModel

from liveloop.models import LoadedModel, load_model
from liveloop.server.engine import (
    ContextLengthError,
    EngineError,
    InvalidRequestError,
    SamplingParams,
    TokenOutput,
    TorchEngine,
    WeightValidationError,
)

PROMPTS = [[1, *range(200, 200 + n)] for n in (3, 17, 8, 30)]
LONG = 1500  # max_tokens of requests a test ends itself


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


@pytest.fixture
async def engine(tiny: LoadedModel) -> AsyncIterator[TorchEngine]:
    # Small prefill chunks so the longer prompts are prefilled over several iterations.
    eng = TorchEngine(tiny.model, tiny.tokenizer, max_batch_size=4, prefill_chunk_tokens=7)
    await eng.start()
    yield eng
    await eng.stop()


@pytest.fixture
def model_copy(tiny: LoadedModel) -> Iterator[PreTrainedModel]:
    """A private copy for tests that change weights."""
    yield copy.deepcopy(tiny.model)


def greedy(max_tokens: int = 12, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)  # type: ignore[arg-type]


async def collect(eng: TorchEngine, prompt: list[int], params: SamplingParams) -> list[TokenOutput]:
    return [t async for t in eng.generate(prompt, params)]


def ref_logprobs(model: PreTrainedModel, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Raw log-probs `[len(tokens), vocab]` of a full forward over prompt + completion."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    return logits.log_softmax(-1)[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


def assert_matches_forward(
    model: PreTrainedModel, prompt: list[int], out: list[TokenOutput]
) -> None:
    ids = [t.token_id for t in out]
    ref = ref_logprobs(model, prompt, ids)
    got = torch.tensor([t.logprob for t in out])
    assert (ref[torch.arange(len(ids)), ids] - got).abs().max().item() < 1e-4
    for row, t in zip(ref, out, strict=True):
        if t.top_logprobs:
            vals, idx = row.topk(len(t.top_logprobs))
            assert [i for i, _ in t.top_logprobs] == idx.tolist()
            assert (
                max(abs(v - lp) for v, (_, lp) in zip(vals.tolist(), t.top_logprobs, strict=True))
                < 1e-4
            )


class AllowOnly:
    """A TokenConstraint allowing a fixed token set, terminating after `stop_after` tokens."""

    def __init__(self, allowed: list[int], stop_after: int | None = None) -> None:
        self.allowed, self.stop_after, self.accepted = allowed, stop_after, list[int]()

    def allowed_token_mask(self, vocab_size: int) -> torch.Tensor | None:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[self.allowed] = True
        return mask

    def accept_token(self, token_id: int) -> None:
        self.accepted.append(token_id)

    def is_terminated(self) -> bool:
        return self.stop_after is not None and len(self.accepted) >= self.stop_after


async def test_logprobs_match_forward_with_batching_and_mid_flight_join(
    engine: TorchEngine, tiny: LoadedModel
) -> None:
    long_prompt = [1, *range(500, 511)]
    gen = engine.generate(long_prompt, greedy(LONG))
    long_out = [await anext(gen)]
    sampled = SamplingParams(max_tokens=40, seed=3, top_logprobs=5, ignore_eos=True)
    first = [
        asyncio.create_task(collect(engine, p, greedy(40) if i % 2 else sampled))
        for i, p in enumerate(PROMPTS[:3])
    ]
    while engine.num_running < 2 or engine.num_waiting:  # all three admitted
        await asyncio.sleep(0.001)
    joiner = await collect(engine, PROMPTS[3], SamplingParams(max_tokens=20, top_p=0.9, seed=1))
    assert engine.num_running >= 1  # the long request was running throughout
    outputs = [*await asyncio.gather(*first), joiner]
    long_out += [await anext(gen) for _ in range(60)]
    await gen.aclose()
    for prompt, out in zip([*PROMPTS, long_prompt], [*outputs, long_out], strict=True):
        assert_matches_forward(tiny.model, prompt, out)


async def test_greedy_alone_equals_batched(engine: TorchEngine) -> None:
    alone = await collect(engine, PROMPTS[1], greedy(20))
    engine.clear_prefix_cache()
    others = [engine.generate(p, greedy(LONG)) for p in (PROMPTS[0], PROMPTS[3])]
    for gen in others:
        await anext(gen)
    batched = await collect(engine, PROMPTS[1], greedy(20))
    assert engine.num_running == 2
    for gen in others:
        await gen.aclose()
    assert [t.token_id for t in alone] == [t.token_id for t in batched]


async def test_small_steps_run_on_one_thread_with_the_same_tokens(tiny: LoadedModel) -> None:
    """Steps under `parallel_min_rows` switch torch to one thread; results do not change."""
    threads = torch.get_num_threads()
    results = []
    for min_rows in (1, 1000):  # every step parallel, then every step on one thread
        eng = TorchEngine(tiny.model, tiny.tokenizer, max_batch_size=4, parallel_min_rows=min_rows)
        await eng.start()
        try:
            outs = await asyncio.gather(*(collect(eng, p, greedy(10)) for p in PROMPTS))
        finally:
            await eng.stop()
        results.append(outs)
        eng._use_threads(2)  # the switch itself, from this thread
        assert torch.get_num_threads() == (1 if min_rows > 2 else threads)
    torch.set_num_threads(threads)
    for parallel, single in zip(*results, strict=True):
        assert [t.token_id for t in parallel] == [t.token_id for t in single]
        lp = torch.tensor([[t.logprob for t in parallel], [t.logprob for t in single]])
        assert torch.allclose(lp[0], lp[1], atol=1e-4)


async def test_request_joins_running_batch(engine: TorchEngine) -> None:
    a = engine.generate(PROMPTS[0], greedy(LONG))
    await anext(a)
    assert engine.num_running == 1
    b = engine.generate(PROMPTS[1], greedy(LONG))
    await anext(b)
    assert engine.num_running == 2  # joined while the first is still running
    await a.aclose()
    await b.aclose()


async def test_waiting_requests_queue_fifo(tiny: LoadedModel) -> None:
    eng = TorchEngine(tiny.model, tiny.tokenizer, max_batch_size=1)
    await eng.start()
    try:
        a = eng.generate(PROMPTS[0], greedy(LONG))
        await anext(a)
        b = asyncio.create_task(collect(eng, PROMPTS[1], greedy(3)))
        while eng.num_waiting == 0:
            await asyncio.sleep(0.001)
        assert eng.num_running == 1
        await a.aclose()
        assert len(await b) == 3
    finally:
        await eng.stop()


async def test_cancellation_frees_slot(engine: TorchEngine) -> None:
    gen = engine.generate(PROMPTS[2], greedy(LONG))
    await anext(gen)
    await gen.aclose()
    assert engine.num_running == 0
    task = asyncio.create_task(collect(engine, PROMPTS[1], greedy(LONG)))
    while engine.num_running == 0:
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.num_running == 0
    assert len(await collect(engine, PROMPTS[0], greedy(3))) == 3  # engine still serves


async def test_seed_reproducible_and_temperature_zero_greedy(
    engine: TorchEngine, tiny: LoadedModel
) -> None:
    params = SamplingParams(max_tokens=15, temperature=1.3, seed=42, ignore_eos=True)
    one, two = await asyncio.gather(*(collect(engine, PROMPTS[1], params) for _ in range(2)))
    other = await collect(
        engine, PROMPTS[1], SamplingParams(max_tokens=15, seed=7, temperature=1.3)
    )
    assert [t.token_id for t in one] == [t.token_id for t in two]
    assert [t.token_id for t in one] != [t.token_id for t in other]
    out = await collect(engine, PROMPTS[2], greedy(10))
    ref = ref_logprobs(tiny.model, PROMPTS[2], [t.token_id for t in out])
    assert [t.token_id for t in out] == ref.argmax(-1).tolist()


async def test_top_p(engine: TorchEngine, tiny: LoadedModel) -> None:
    tiny_p = await collect(
        engine, PROMPTS[0], SamplingParams(max_tokens=8, top_p=1e-6, ignore_eos=True)
    )
    assert [t.token_id for t in tiny_p] == [
        t.token_id for t in await collect(engine, PROMPTS[0], greedy(8))
    ]
    out = await collect(
        engine, PROMPTS[3], SamplingParams(max_tokens=30, top_p=0.3, seed=5, ignore_eos=True)
    )
    probs = ref_logprobs(tiny.model, PROMPTS[3], [t.token_id for t in out]).exp()
    for row, t in zip(probs, out, strict=True):
        assert row[row > row[t.token_id]].sum().item() < 0.3  # inside the nucleus


async def test_stop_strings(engine: TorchEngine, tiny: LoadedModel) -> None:
    full = [t.token_id for t in await collect(engine, PROMPTS[1], greedy(20))]
    text = str(tiny.tokenizer.decode(full[6:8], skip_special_tokens=True))
    stop = text.strip()[:3] or text
    first = next(
        k for k in range(1, 21) if stop in tiny.tokenizer.decode(full[:k], skip_special_tokens=True)
    )
    out = await collect(engine, PROMPTS[1], greedy(20, stop=["\x00never", stop]))
    assert [t.token_id for t in out] == full[:first]
    assert out[-1].finish_reason == "stop" and out[-1].stop_string == stop
    assert all(t.finish_reason is None for t in out[:-1])


async def test_stop_token_ids_eos_and_length(engine: TorchEngine) -> None:
    full = [t.token_id for t in await collect(engine, PROMPTS[2], greedy(12))]
    out = await collect(engine, PROMPTS[2], greedy(12, stop_token_ids=[full[4]]))
    assert [t.token_id for t in out] == full[: full.index(full[4]) + 1]
    assert out[-1].finish_reason == "stop"
    eos = tiny_eos(engine)
    only_eos = SamplingParams(max_tokens=5, constraint=AllowOnly([eos]))
    assert [t.finish_reason for t in await collect(engine, PROMPTS[0], only_eos)] == ["stop"]
    ignoring = SamplingParams(max_tokens=5, constraint=AllowOnly([eos]), ignore_eos=True)
    out = await collect(engine, PROMPTS[0], ignoring)
    assert len(out) == 5 and out[-1].finish_reason == "length"
    assert all(t.finish_reason is None for t in out[:-1])


def tiny_eos(engine: TorchEngine) -> int:
    assert engine.eos_token_ids
    return min(engine.eos_token_ids)


async def test_constraint_respected(engine: TorchEngine) -> None:
    allowed = [300, 301, 302]
    grammar = AllowOnly(allowed, stop_after=6)
    out = await collect(
        engine, PROMPTS[3], SamplingParams(max_tokens=50, seed=0, constraint=grammar)
    )
    assert len(out) == 6 and out[-1].finish_reason == "stop"
    assert {t.token_id for t in out} <= set(allowed)
    assert grammar.accepted == [t.token_id for t in out]


async def test_context_length(tiny: LoadedModel) -> None:
    eng = TorchEngine(tiny.model, tiny.tokenizer, max_model_len=32)
    await eng.start()
    try:
        with pytest.raises(ContextLengthError):
            eng.generate(list(range(100, 132)), greedy(1))
        out = await collect(eng, list(range(100, 128)), greedy(50))
        assert len(out) == 4 and out[-1].finish_reason == "length"
        with pytest.raises(InvalidRequestError):
            eng.generate([], greedy(1))
        with pytest.raises(InvalidRequestError):
            eng.generate([eng.vocab_size], greedy(1))
    finally:
        await eng.stop()


async def test_stop_fails_pending_requests(tiny: LoadedModel) -> None:
    eng = TorchEngine(tiny.model, tiny.tokenizer)
    await eng.start()
    gen = eng.generate(PROMPTS[0], greedy(LONG))
    await anext(gen)
    await eng.stop()
    with pytest.raises(EngineError):
        async for _ in gen:
            pass
    with pytest.raises(EngineError):
        eng.generate(PROMPTS[0], greedy(1))


def perturbed(model: PreTrainedModel, scale: float = 0.05) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        k: v + scale * torch.randn(v.shape, generator=gen)
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"  # tied: leaving it out must be accepted
    }


async def test_swap_weights_mid_generation(model_copy: PreTrainedModel, tiny: LoadedModel) -> None:
    old = copy.deepcopy(model_copy)
    eng = TorchEngine(model_copy, tiny.tokenizer, version=3)
    await eng.start()
    try:
        gen = eng.generate(PROMPTS[1], greedy(LONG))
        out = [await anext(gen) for _ in range(3)]
        pause = await eng.swap_weights(perturbed(old), version=4)
        assert pause >= 0 and eng.version == 4
        async for t in gen:
            out.append(t)
            if sum(x.version == 4 for x in out) >= 10:
                break
        await gen.aclose()
        versions = [t.version for t in out]
        k = versions.index(4)
        assert k >= 3 and set(versions[:k]) == {3} and set(versions[k:]) == {4}
        # Tokens after the swap: new weights attending to the old weights' cached keys.
        ids = torch.tensor([PROMPTS[1] + [t.token_id for t in out]])
        split = len(PROMPTS[1]) + k - 1
        with torch.no_grad():
            past = old(ids[:, :split], use_cache=True).past_key_values
            logits = model_copy(ids[:, split:], past_key_values=past).logits[0].float()
        ref = logits.log_softmax(-1)[torch.arange(len(out) - k), ids[0, split + 1 :]]
        assert (ref - torch.tensor([t.logprob for t in out[k:]])).abs().max().item() < 1e-4
        fresh = await collect(eng, PROMPTS[2], SamplingParams(max_tokens=10, seed=1))
        assert all(t.version == 4 for t in fresh)
        assert_matches_forward(model_copy, PROMPTS[2], fresh)
    finally:
        await eng.stop()


async def test_bad_state_dicts_rejected(model_copy: PreTrainedModel, tiny: LoadedModel) -> None:
    eng = TorchEngine(model_copy, tiny.tokenizer)
    await eng.start()
    try:
        gen = eng.generate(PROMPTS[0], greedy(LONG))
        await anext(gen)
        good = perturbed(model_copy)
        name = "model.layers.0.self_attn.q_proj.weight"
        bad = {
            "missing": {k: v for k, v in good.items() if k != name},
            "shape": {**good, name: good[name][:-1]},
            "dtype": {**good, name: good[name].double()},
            "nan": {
                **good,
                name: good[name].clone().index_fill_(0, torch.tensor([0]), float("nan")),
            },
            "unexpected": {**good, "extra.weight": good[name]},
            "untied": {**good, "lm_head.weight": good["model.embed_tokens.weight"] + 1},
        }
        before = {k: v.clone() for k, v in model_copy.state_dict().items()}
        for problem, sd in bad.items():
            with pytest.raises(WeightValidationError) as info:
                await eng.swap_weights(sd, version=1)
            assert (
                problem in str(info.value)
                or name in str(info.value)
                or "lm_head" in str(info.value)
            )
        assert eng.version == 0
        assert all(torch.equal(v, before[k]) for k, v in model_copy.state_dict().items())
        more = [await anext(gen) for _ in range(5)]
        assert all(t.version == 0 for t in more)
        await gen.aclose()
        eng.validate_state_dict({**good, "lm_head.weight": good["model.embed_tokens.weight"]})
    finally:
        await eng.stop()


async def test_swap_without_running_loop_applies_at_once(
    model_copy: PreTrainedModel, tiny: LoadedModel
) -> None:
    eng = TorchEngine(model_copy, tiny.tokenizer)
    new = perturbed(model_copy)
    await eng.swap_weights(new, version=9)
    assert eng.version == 9
    assert torch.equal(model_copy.state_dict()["lm_head.weight"], new["model.embed_tokens.weight"])


class Broken(AllowOnly):
    """A grammar hook that raises, as a buggy xgrammar matcher might."""

    def allowed_token_mask(self, vocab_size: int) -> torch.Tensor | None:
        raise RuntimeError("matcher exploded")


async def test_failing_constraint_fails_only_its_request(engine: TorchEngine) -> None:
    other = asyncio.create_task(collect(engine, PROMPTS[0], greedy(30)))
    with pytest.raises(EngineError, match="matcher exploded"):
        await collect(engine, PROMPTS[1], SamplingParams(max_tokens=5, constraint=Broken([1])))
    assert len(await other) == 30


async def test_internal_failure_fails_batch_and_engine_recovers(
    engine: TorchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = engine.generate(PROMPTS[0], greedy(LONG))
    await anext(gen)

    def broken_decode(*args: object) -> torch.Tensor:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(engine._runner, "decode", broken_decode)
    with pytest.raises(EngineError, match="out of memory"):
        async for _ in gen:
            pass
    monkeypatch.undo()
    assert len(await collect(engine, PROMPTS[1], greedy(4))) == 4


async def test_prefix_cache_reuses_shared_prefix_and_multi_turn(
    engine: TorchEngine, tiny: LoadedModel
) -> None:
    system = [1, *range(600, 640)]
    first = await collect(engine, [*system, 7, 8, 9], greedy(10))
    hits = engine.stats.prefix_hit_tokens
    other = await collect(engine, [*system, 11, 12], greedy(10))
    assert engine.stats.prefix_hit_tokens - hits == len(system)
    assert_matches_forward(tiny.model, [*system, 11, 12], other)
    # Next turn of the first conversation: prompt + completion + new message.
    turn2 = [*system, 7, 8, 9, *[t.token_id for t in first], 13, 14]
    hits = engine.stats.prefix_hit_tokens
    out = await collect(engine, turn2, SamplingParams(max_tokens=10, seed=2, top_logprobs=3))
    assert engine.stats.prefix_hit_tokens - hits == len(system) + 3 + len(first) - 1
    assert_matches_forward(tiny.model, turn2, out)


async def test_prefix_cache_cleared_by_swap(model_copy: PreTrainedModel, tiny: LoadedModel) -> None:
    eng = TorchEngine(model_copy, tiny.tokenizer)
    await eng.start()
    try:
        await collect(eng, PROMPTS[3], greedy(3))
        await eng.swap_weights(perturbed(model_copy), version=1)
        hits = eng.stats.prefix_hit_tokens
        out = await collect(eng, PROMPTS[3], greedy(5))
        assert eng.stats.prefix_hit_tokens == hits
        assert_matches_forward(model_copy, PROMPTS[3], out)
        again = await collect(eng, PROMPTS[3], greedy(5))
        assert eng.stats.prefix_hit_tokens - hits == len(PROMPTS[3]) - 1
        assert [t.token_id for t in again] == [t.token_id for t in out]
    finally:
        await eng.stop()


async def test_a_flood_of_cached_one_token_requests_holds_back_no_swap(
    model_copy: PreTrainedModel, tiny: LoadedModel
) -> None:
    """Prompts found in the prefix cache cost one token of the prefill budget and one-token
    requests leave the batch at once: admitting them must still yield to a waiting swap."""
    eng = TorchEngine(model_copy, tiny.tokenizer, max_batch_size=4, version=1)
    await eng.start()
    try:
        await collect(eng, PROMPTS[3], greedy(1))  # the prompt is in the prefix cache now
        new_weights = perturbed(model_copy)
        flood = [asyncio.create_task(collect(eng, PROMPTS[3], greedy(1))) for _ in range(300)]
        await asyncio.sleep(0)  # every request queued before the swap
        await eng.swap_weights(new_weights, version=2)
        versions = [out[0].version for out in await asyncio.gather(*flood)]
        # The decode thread goes on admitting (4 a step) while the swap is validated in a
        # thread, so how many reach v1 depends on the machine's load (6-12 alone, 18 seen in
        # CI, 79 beside another pytest worker); a swap held back by the flood would leave
        # all 300 on v1.
        assert versions.count(1) <= 200, versions.count(1)
        assert versions.count(2) >= 100 and set(versions) <= {1, 2}
    finally:
        await eng.stop()
