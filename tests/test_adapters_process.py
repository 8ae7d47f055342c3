"""LoRA adapters through the engine worker process (`EngineProcess`), tiny-random.

The same engine as in-process, across the socket: loading and refusing adapters, requests
naming one, the reload-wait metric reported by the worker, and a restarted worker that
serves again the adapters the dead one served.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from liveloop.models import LoadedModel, load_model
from liveloop.server.engine import SamplingParams, TokenOutput, UnknownAdapterError
from liveloop.server.engine.process import EngineOptions, EngineProcess
from liveloop.weights.adapter import AdapterError
from tests.support.adapters import MadeAdapter, make_adapter
from tests.test_adapters_engine import PROMPTS, check_against

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny-random")


@pytest.fixture(scope="module")
def made(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, MadeAdapter]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_adapter(tiny.model, root / "a", 1, rank=8),
        "b": make_adapter(tiny.model, root / "b", 2, rank=4, targets=("q_proj", "up_proj")),
    }


async def collect(engine: EngineProcess, prompt: list[int], adapter: str) -> list[TokenOutput]:
    return [t async for t in engine.generate(prompt, GREEDY, adapter=adapter)]


async def test_adapters_across_the_worker_and_back_after_a_crash(
    made: dict[str, MadeAdapter], tmp_path: Path
) -> None:
    engine = EngineProcess(
        EngineOptions(model="tiny-random", torch_threads=1, max_loaded_adapters=1)
    )
    registry = CollectorRegistry()
    engine.bind_metrics(registry)
    await engine.start()
    try:
        await engine.load_adapter("a", 1, str(made["a"].path))
        await engine.load_adapter("b", 2, str(made["b"].path))  # only one fits: evicts `a`
        assert engine.adapters() == {"a": 1, "b": 2}
        with pytest.raises(UnknownAdapterError):
            engine.generate(PROMPTS[0], GREEDY, adapter="zzz")
        with pytest.raises(AdapterError):
            await engine.load_adapter("c", 1, str(tmp_path / "nowhere"))
        assert engine.adapters() == {"a": 1, "b": 2}

        out_a, out_b = await asyncio.gather(
            collect(engine, PROMPTS[1], "a"), collect(engine, PROMPTS[2], "b")
        )
        check_against(made["a"].merged, PROMPTS[1], out_a)
        check_against(made["b"].merged, PROMPTS[2], out_b)
        assert {t.version for t in out_a} == {1} and {t.version for t in out_b} == {2}
        waits = registry.get_sample_value("liveloop_adapter_reload_wait_seconds_count") or 0
        assert waits >= 1  # one of the two waited for its adapter to be read back

        assert engine._proc is not None
        dead = engine._proc.pid
        os.kill(dead, signal.SIGKILL)
        for _ in range(1200):  # a new worker: spawn, load the model, restore the adapters
            await asyncio.sleep(0.05)
            if engine.is_running and engine._proc is not None and engine._proc.pid != dead:
                break
        assert engine.is_running and engine.adapters() == {"a": 1, "b": 2}
        check_against(made["a"].merged, PROMPTS[3], await collect(engine, PROMPTS[3], "a"))
        await engine.unload_adapter("a")
        assert engine.adapters() == {"b": 2}
    finally:
        await engine.stop()
