"""Many LoRA adapters in one torch engine, against PEFT's own merged models (tiny-random).

The reference for a row on adapter X is a plain HF forward of the base with X merged into
its weights (PEFT's `merge_and_unload`): the engine must give the same log-probs (to a
tolerance) and the same greedy tokens while decoding rows on different adapters in one
batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from liveloop.models import LoadedModel, load_model
from liveloop.server.engine import (
    SamplingParams,
    TokenOutput,
    TorchEngine,
    UnknownAdapterError,
)
from liveloop.weights import CheckpointError
from liveloop.weights.adapter import AdapterError
from tests.support.adapters import MadeAdapter, make_adapter

PROMPTS = [[1, *range(300 + 7 * i, 300 + 7 * i + n)] for i, n in enumerate((5, 19, 11, 26))]
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


@pytest.fixture(scope="module")
def made(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, MadeAdapter]:
    """Adapters of different ranks, targets and scalings (and a second version of `a`)."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_adapter(tiny.model, root / "a1", 1, rank=8),
        "a2": make_adapter(tiny.model, root / "a2", 11, rank=8),
        "b": make_adapter(tiny.model, root / "b", 2, rank=4, targets=("q_proj", "v_proj")),
        "c": make_adapter(
            tiny.model,
            root / "c",
            3,
            rank=16,
            alpha=4,
            targets=("o_proj", "down_proj"),
            use_rslora=True,
        ),
    }


@pytest.fixture
async def engine(tiny: LoadedModel) -> AsyncIterator[TorchEngine]:
    eng = TorchEngine(
        tiny.model, tiny.tokenizer, max_batch_size=4, prefill_chunk_tokens=7, max_loaded_adapters=3
    )
    await eng.start()
    yield eng
    await eng.stop()


def greedy(max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def collect(
    eng: TorchEngine, prompt: list[int], adapter: str | None, max_tokens: int = 10
) -> list[TokenOutput]:
    return [t async for t in eng.generate(prompt, greedy(max_tokens), adapter=adapter)]


def check_against(model: Any, prompt: list[int], out: list[TokenOutput]) -> None:
    """Same greedy tokens and log-probs (to TOL) as a full forward of `model`."""
    tokens = [t.token_id for t in out]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    ref = logits.log_softmax(-1)[len(prompt) - 1 : -1]
    assert ref.argmax(-1).tolist() == tokens
    mine = torch.tensor([t.logprob for t in out])
    picked = ref.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert (mine - picked).abs().max().item() < TOL


async def test_rows_on_different_adapters_decode_together_as_if_merged(
    engine: TorchEngine, made: dict[str, MadeAdapter], tiny: LoadedModel
) -> None:
    for name, version in (("a", 1), ("b", 4), ("c", 9)):
        await engine.load_adapter(name, version, str(made[name].path))
    assert engine.adapters() == {"a": 1, "b": 4, "c": 9}
    plan = [("a", PROMPTS[0]), ("b", PROMPTS[1]), (None, PROMPTS[2]), ("c", PROMPTS[3])]
    before = engine.stats.decode_steps
    outs = await asyncio.gather(*(collect(engine, p, name, 12) for name, p in plan))
    assert engine.stats.decode_steps - before < sum(len(o) for o in outs) / 2  # batched
    refs = {"a": made["a"].merged, "b": made["b"].merged, "c": made["c"].merged, None: tiny.model}
    for (name, prompt), out in zip(plan, outs, strict=True):
        check_against(refs[name], prompt, out)
        assert {t.version for t in out} == {engine.adapters().get(name or "", 0)}
    # The adapters matter: the same prompt gives other tokens on each.
    same = await asyncio.gather(*(collect(engine, PROMPTS[1], n) for n in ("a", "b", "c", None)))
    assert len({tuple(t.token_id for t in o) for o in same}) == 4


async def test_an_adapter_update_mid_stream_moves_its_rows_only(
    engine: TorchEngine, made: dict[str, MadeAdapter]
) -> None:
    await engine.load_adapter("a", 1, str(made["a"].path))
    await engine.load_adapter("b", 5, str(made["b"].path))
    stream_a = engine.generate(PROMPTS[3], greedy(200), adapter="a")
    b_task = asyncio.create_task(collect(engine, PROMPTS[1], "b", 200))
    got: list[TokenOutput] = []
    async for token in stream_a:
        got.append(token)
        if len(got) == 5:
            await engine.load_adapter("a", 2, str(made["a2"].path))
    versions = [t.version for t in got]
    assert versions == sorted(versions) and versions[0] == 1 and versions[-1] == 2
    b_out = await b_task
    assert {t.version for t in b_out} == {5}
    check_against(made["b"].merged, PROMPTS[1], b_out)
    assert engine.adapters() == {"a": 2, "b": 5}
    check_against(made["a2"].merged, PROMPTS[0], await collect(engine, PROMPTS[0], "a"))


async def test_rolling_one_adapter_back_leaves_the_others(
    engine: TorchEngine, made: dict[str, MadeAdapter]
) -> None:
    await engine.load_adapter("a", 1, str(made["a"].path))
    await engine.load_adapter("b", 3, str(made["b"].path))
    await engine.load_adapter("a", 2, str(made["a2"].path))
    check_against(made["a2"].merged, PROMPTS[2], await collect(engine, PROMPTS[2], "a"))
    await engine.load_adapter("a", 1, str(made["a"].path))  # roll back
    assert engine.adapters() == {"a": 1, "b": 3}
    out = await collect(engine, PROMPTS[2], "a")
    check_against(made["a"].merged, PROMPTS[2], out)
    assert {t.version for t in out} == {1}
    check_against(made["b"].merged, PROMPTS[2], await collect(engine, PROMPTS[2], "b"))


async def test_a_prompt_cached_on_the_base_is_recomputed_on_an_adapter(
    engine: TorchEngine, made: dict[str, MadeAdapter], tiny: LoadedModel
) -> None:
    prompt = [1, *range(400, 440)]  # several 16-token blocks
    await engine.load_adapter("a", 1, str(made["a"].path))
    check_against(tiny.model, prompt, await collect(engine, prompt, None))
    hits = engine.stats.prefix_hit_tokens
    check_against(made["a"].merged, prompt, await collect(engine, prompt, "a"))
    assert engine.stats.prefix_hit_tokens == hits  # the base's keys/values were not used
    check_against(made["a"].merged, prompt, await collect(engine, prompt, "a"))
    assert engine.stats.prefix_hit_tokens > hits  # but the adapter's own are


def sample(registry: CollectorRegistry, name: str, labels: dict[str, str] | None = None) -> float:
    return registry.get_sample_value(name, labels or {}) or 0.0


async def test_evicted_adapters_come_back_from_their_checkpoint(
    engine: TorchEngine, made: dict[str, MadeAdapter]
) -> None:
    registry = CollectorRegistry()
    engine.bind_metrics(registry)
    for name, key in (("a", "a"), ("b", "b"), ("c", "c"), ("d", "a2")):  # 4 > 3 in memory
        await engine.load_adapter(name, 1, str(made[key].path))
    assert engine.adapters() == {"a": 1, "b": 1, "c": 1, "d": 1}
    assert sample(registry, "liveloop_adapter_evictions_total") == 1  # `a`, least recent
    running = engine.generate(PROMPTS[0], greedy(60), adapter="b")
    first = await running.__anext__()  # `b` is in use from here: it cannot be evicted
    out = await collect(engine, PROMPTS[1], "a")  # read back, evicting `c`
    check_against(made["a"].merged, PROMPTS[1], out)
    assert sample(registry, "liveloop_adapter_reload_wait_seconds_count") == 1
    assert sample(registry, "liveloop_adapter_reload_wait_seconds_sum") > 0
    assert sample(registry, "liveloop_adapter_reloads_total", {"outcome": "ok"}) == 1
    assert sample(registry, "liveloop_adapter_evictions_total") == 2
    check_against(made["b"].merged, PROMPTS[0], [first, *[t async for t in running]])
    check_against(made["c"].merged, PROMPTS[2], await collect(engine, PROMPTS[2], "c"))
    assert sample(registry, "liveloop_adapter_reload_wait_seconds_count") == 2
    assert sample(registry, "liveloop_adapter_evictions_total") == 3  # `d` made room
    assert engine.adapters() == {"a": 1, "b": 1, "c": 1, "d": 1}


async def test_a_deleted_checkpoint_fails_only_the_requests_that_need_it(
    engine: TorchEngine, made: dict[str, MadeAdapter], tiny: LoadedModel, tmp_path: Path
) -> None:
    registry = CollectorRegistry()
    engine.bind_metrics(registry)
    doomed = make_adapter(tiny.model, tmp_path / "doomed", 7, rank=2, merge=False)
    await engine.load_adapter("doomed", 1, str(doomed.path))
    for name in ("a", "b", "c"):  # evict `doomed`
        await engine.load_adapter(name, 1, str(made[name].path))
    (doomed.path / "adapter_model.safetensors").unlink()
    with pytest.raises(Exception, match="could not be read back"):
        await collect(engine, PROMPTS[0], "doomed")
    assert sample(registry, "liveloop_adapter_reloads_total", {"outcome": "failed"}) == 1
    check_against(made["b"].merged, PROMPTS[0], await collect(engine, PROMPTS[0], "b"))


@pytest.mark.parametrize("how", ["nan", "shape", "missing-file"])
async def test_a_corrupt_adapter_is_refused_while_the_others_serve(
    engine: TorchEngine, made: dict[str, MadeAdapter], tmp_path: Path, how: str
) -> None:
    from tests.test_adapters_lora import corrupt

    await engine.load_adapter("a", 1, str(made["a"].path))
    await engine.load_adapter("b", 2, str(made["b"].path))
    bad = (
        tmp_path / "missing"
        if how == "missing-file"
        else corrupt(made["a2"].path, tmp_path / how, how)
    )
    running = asyncio.create_task(collect(engine, PROMPTS[3], "b", 40))
    for name in ("a", "new"):  # a new version of `a`, and a new adapter
        with pytest.raises(AdapterError) as refused:
            await engine.load_adapter(name, 3, str(bad))
        assert isinstance(refused.value, CheckpointError)
    assert engine.adapters() == {"a": 1, "b": 2}
    check_against(made["b"].merged, PROMPTS[3], await running)
    check_against(made["a"].merged, PROMPTS[1], await collect(engine, PROMPTS[1], "a"))
    with pytest.raises(UnknownAdapterError):
        engine.generate(PROMPTS[0], greedy(), adapter="new")


async def test_unloading_lets_running_rows_finish_and_refuses_new_ones(
    engine: TorchEngine, made: dict[str, MadeAdapter]
) -> None:
    await engine.load_adapter("a", 1, str(made["a"].path))
    stream = engine.generate(PROMPTS[1], greedy(30), adapter="a")
    first = await stream.__anext__()
    await engine.unload_adapter("a")
    rest = [t async for t in stream]
    out = [first, *rest]
    assert len(out) == 30 and rest[-1].finish_reason == "length"
    check_against(made["a"].merged, PROMPTS[1], out)
    assert engine.adapters() == {}
    with pytest.raises(UnknownAdapterError):
        engine.generate(PROMPTS[0], greedy(), adapter="a")
    with pytest.raises(UnknownAdapterError):
        await engine.unload_adapter("a")


async def test_a_request_waiting_for_a_memory_slot_is_not_overtaken(
    tiny: LoadedModel, made: dict[str, MadeAdapter]
) -> None:
    eng = TorchEngine(tiny.model, tiny.tokenizer, max_batch_size=4, max_loaded_adapters=1)
    await eng.start()
    try:
        await eng.load_adapter("a", 1, str(made["a"].path))
        await eng.load_adapter("b", 1, str(made["b"].path))  # evicts `a`: one slot only
        first_on_b = eng.generate(PROMPTS[0], greedy(30), adapter="b")
        await first_on_b.__anext__()  # `b` holds the only slot while this runs
        started: list[str] = []

        async def run(name: str, prompt: list[int]) -> list[TokenOutput]:
            out = []
            async for token in eng.generate(prompt, greedy(6), adapter=name):
                if not out:
                    started.append(name)
                out.append(token)
            return out

        on_a = asyncio.create_task(run("a", PROMPTS[1]))
        await asyncio.sleep(0.05)
        later_on_b = asyncio.create_task(run("b", PROMPTS[2]))
        rest = [t async for t in first_on_b]
        assert rest[-1].finish_reason == "length"
        check_against(made["a"].merged, PROMPTS[1], await on_a)
        check_against(made["b"].merged, PROMPTS[2], await later_on_b)
        assert started == ["a", "b"]  # `b`'s newer request waited for `a` to get the slot
    finally:
        await eng.stop()
