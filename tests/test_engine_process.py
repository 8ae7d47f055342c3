"""The engine worker process against the in-process TorchEngine on the real tiny-random model."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from liveloop.models import LoadedModel, ModelLoadError, load_model
from liveloop.server.engine import EngineError, SamplingParams, TokenOutput, TorchEngine
from liveloop.server.engine.process import EngineOptions, EngineProcess
from liveloop.server.tools import build_constraint
from liveloop.weights import CheckpointError

PROMPT = [1, *range(300, 330)]


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


@pytest.fixture
async def worker() -> AsyncIterator[EngineProcess]:
    engine = EngineProcess(EngineOptions(model="tiny-random", max_batch_size=4, torch_threads=1))
    await engine.start()
    yield engine
    await engine.stop()


async def collect(engine: EngineProcess | TorchEngine, params: SamplingParams) -> list[TokenOutput]:
    return [out async for out in engine.generate(PROMPT, params)]


async def test_same_tokens_and_logprobs_as_in_process(
    worker: EngineProcess, tiny: LoadedModel
) -> None:
    local = TorchEngine(tiny.model, tiny.tokenizer, max_batch_size=4)
    await local.start()
    try:
        for params in (
            SamplingParams(max_tokens=12, temperature=0.0, top_logprobs=2),
            SamplingParams(max_tokens=12, temperature=0.8, seed=11, ignore_eos=True),
        ):
            remote, here = await collect(worker, params), await collect(local, params)
            assert [t.token_id for t in remote] == [t.token_id for t in here]
            assert [[i for i, _ in t.top_logprobs] for t in remote] == [
                [i for i, _ in t.top_logprobs] for t in here
            ]
            for a, b in zip(remote, here, strict=True):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert remote[-1].finish_reason == here[-1].finish_reason
    finally:
        await local.stop()
    assert worker.vocab_size == local.vocab_size and worker.max_model_len == local.max_model_len
    assert worker.eos_token_ids == local.eos_token_ids


async def test_constraint_is_rebuilt_in_the_worker(
    worker: EngineProcess, tiny: LoadedModel
) -> None:
    factory = build_constraint(
        tiny.tokenizer,
        tools=None,
        tool_choice=None,
        response_format={"type": "json_object"},
        vocab_size=worker.vocab_size,
    )
    assert factory is not None
    params = SamplingParams(max_tokens=60, seed=3, constraint=factory.new())
    out = await collect(worker, params)
    text = tiny.tokenizer.decode([t.token_id for t in out], skip_special_tokens=True)
    assert text.lstrip().startswith("{")  # a random model writes JSON only when made to

    class Opaque:
        def allowed_token_mask(self, vocab_size: int) -> torch.Tensor | None:
            return None

        def accept_token(self, token_id: int) -> None: ...

        def is_terminated(self) -> bool:
            return False

    with pytest.raises(EngineError, match="cannot be sent"):
        worker.generate(PROMPT, SamplingParams(max_tokens=2, constraint=Opaque()))


async def until_idle(worker: EngineProcess) -> None:
    """Wait (up to 2 s) until the worker reports no running request."""
    for _ in range(200):
        if worker.num_running == 0:
            return
        await asyncio.sleep(0.01)


async def test_bad_requests_fail_up_front_and_cancel_frees_the_slot(worker: EngineProcess) -> None:
    with pytest.raises(EngineError):
        worker.generate([], SamplingParams(max_tokens=2))
    with pytest.raises(EngineError):
        worker.generate([worker.vocab_size], SamplingParams(max_tokens=2))
    stream = worker.generate(PROMPT, SamplingParams(max_tokens=1500, ignore_eos=True))
    await anext(stream)
    assert worker.num_running == 1
    await stream.aclose()
    await until_idle(worker)
    assert worker.num_running == 0
    # Closed from another thread (as garbage collection may do): still one clean cancel.
    other = worker.generate(PROMPT, SamplingParams(max_tokens=1500, ignore_eos=True))
    await anext(other)
    await asyncio.to_thread(other.close)
    await until_idle(worker)
    assert worker.num_running == 0
    assert len(await collect(worker, SamplingParams(max_tokens=3, ignore_eos=True))) == 3


async def test_load_weights_swaps_and_refuses_bad_checkpoints(
    worker: EngineProcess, tiny: LoadedModel, tmp_path: Path
) -> None:
    before = await collect(worker, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    changed = {  # lm_head is tied to the embeddings: a checkpoint may leave it out
        k: v + 0.5 * torch.randn_like(v)
        for k, v in tiny.model.state_dict().items()
        if k != "lm_head.weight"
    }
    tiny.model.save_pretrained(tmp_path / "v1", state_dict=changed)
    pause = await worker.load_weights(str(tmp_path / "v1"), 1)
    assert pause >= 0 and worker.version == 1
    after = await collect(worker, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert {t.version for t in after} == {1}
    assert [t.logprob for t in after] != [t.logprob for t in before]
    with pytest.raises(CheckpointError):
        await worker.load_weights(str(tmp_path / "missing"), 2)
    assert worker.version == 1 and worker.is_running  # a bad checkpoint never stops serving


async def test_a_dead_worker_fails_open_requests_and_comes_back_with_its_weights(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    engine = EngineProcess(EngineOptions(model="tiny-random", torch_threads=1))
    await engine.start()
    try:
        tiny.model.save_pretrained(tmp_path / "v3")
        await engine.load_weights(str(tmp_path / "v3"), 3)
        stream = engine.generate(PROMPT, SamplingParams(max_tokens=1500, ignore_eos=True))
        await anext(stream)
        assert engine._proc is not None
        os.kill(engine._proc.pid, signal.SIGKILL)
        with pytest.raises(EngineError):
            async for _ in stream:
                pass
        assert not engine.is_running
        with pytest.raises(EngineError):
            engine.generate(PROMPT, SamplingParams(max_tokens=2))
        for _ in range(1200):  # a new worker: spawn, load the model, reload v3
            if engine.is_running:
                break
            await asyncio.sleep(0.05)
        assert engine.is_running and engine.version == 3
        out = await collect(engine, SamplingParams(max_tokens=3, ignore_eos=True))
        assert [t.version for t in out] == [3, 3, 3]
    finally:
        await engine.stop()


def test_spawn_reports_a_model_that_cannot_load(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="broken"):
        EngineProcess(EngineOptions(model=str(broken))).spawn()
