"""LoRA adapters through the SGLang gateway, against two real SGLang servers with LoRA on.

The gateway loads each adapter version into both replicas under a versioned name and
requests carry it as `lora_path`; the references are PEFT's own merged models (greedy
tokens and log-probs of a plain HF forward). The first server takes ranks up to 8 only
(`--max-lora-rank 8`), so a rank-16 adapter fails there and loads on the second: the
failed replica keeps the previous version and is retried.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from liveloop.models import load_model, load_tokenizer
from liveloop.server.engine import SamplingParams, TokenOutput, UnknownAdapterError
from liveloop.server.engine.sglang import SGLangEngine
from liveloop.server.engine.sglang.pool import Replica
from liveloop.weights.adapter import AdapterError
from tests.sglang_fixtures import lora_config
from tests.support.adapters import make_adapter
from tests.support.sglang import MODEL, SGLangServers

pytest_plugins = ["tests.sglang_fixtures"]
# The first test also waits for two SGLang servers to start (minutes on a loaded machine).
pytestmark = [pytest.mark.sglang, pytest.mark.sglang_launch, pytest.mark.timeout(1500)]

TOL = 2e-3
REF_TOKENS = 40


@dataclass
class Reference:
    """An adapter (or the base, `path` None) and its greedy continuation of PROMPT:
    tokens and raw log-probs of a plain HF forward of the base with it merged in."""

    path: Path | None
    tokens: list[int]
    logprobs: list[float]


def greedy_reference(model: Any, prompt: list[int]) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=REF_TOKENS,
            min_new_tokens=REF_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = torch.stack(out.logits)[:, 0].float().log_softmax(-1)
    return tokens, logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    tokenizer = load_tokenizer(MODEL)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colours."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    return list(tokenizer(text)["input_ids"])


@pytest.fixture(scope="module")
def refs(prompt: list[int], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Reference]:
    """The adapters and their references, computed before the servers start (the merged
    models are freed: memory is short with two SGLang servers up)."""
    root = tmp_path_factory.mktemp("lora")
    base = load_model(MODEL).model
    small: dict[str, Any] = {"scale": 0.05, "rank": 8}
    specs: dict[str, dict[str, Any]] = {
        "v1": {"seed": 1, **small},
        "v2": {"seed": 2, **small},
        "other": {"seed": 3, "targets": ("q_proj", "v_proj"), **small},
        "rank16": {"seed": 4, "rank": 16, "scale": 0.05},
    }
    found = {"base": Reference(None, *greedy_reference(base, prompt))}
    for name, spec in specs.items():
        made = make_adapter(base, root / name, **spec)
        found[name] = Reference(made.path, *greedy_reference(made.merged, prompt))
        del made
        gc.collect()
    unmerged = make_adapter(base, root / "rank32", 5, rank=32, scale=0.05, merge=False)
    found["rank32"] = Reference(unmerged.path, [], [])
    return found


@pytest.fixture
async def engine(
    refs: dict[str, Reference], sglang_lora_servers: SGLangServers
) -> AsyncIterator[SGLangEngine]:
    urls = [s.url for s in sglang_lora_servers.servers]
    # A patient health check: four agents share this machine's two cores.
    cfg = lora_config(urls=urls, health_timeout_s=30.0, retry_backoff_s=(1.0, 2.0))
    eng = SGLangEngine(MODEL, cfg)
    await eng.start()
    yield eng
    await eng.stop()


def replicas(engine: SGLangEngine) -> list[Replica]:
    assert engine._pool is not None
    return engine._pool.replicas


def session_on(engine: SGLangEngine, index: int) -> str:
    """A session id the gateway routes to replica `index`."""
    assert engine._pool is not None
    target = replicas(engine)[index]
    return next(
        k for k in (f"s{i}" for i in range(1000)) if next(engine._pool.ring.walk(k)) is target
    )


async def run(
    engine: SGLangEngine, prompt: list[int], adapter: str | None, tokens: int = 8, on: int = 0
) -> list[TokenOutput]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    stream = engine.generate(prompt, params, affinity=session_on(engine, on), adapter=adapter)
    return [t async for t in stream]


def versions_of(out: list[TokenOutput]) -> list[int]:
    assert out[-1].versions is not None
    return out[-1].versions


def check(ref: Reference, out: list[TokenOutput]) -> None:
    """SGLang's tokens are the reference's greedy ones, its log-probs close to them."""
    assert [t.token_id for t in out] == ref.tokens[: len(out)]
    for token, logprob in zip(out, ref.logprobs, strict=False):
        assert abs(token.logprob - logprob) < TOL


def path(refs: dict[str, Reference], name: str) -> str:
    found = refs[name].path
    assert found is not None
    return str(found)


def loaded_on(replica: Replica) -> set[str]:
    """The adapter names SGLang itself lists on a server."""
    models = httpx.get(replica.url + "/v1/models", timeout=10).json()["data"]
    return {m["id"] for m in models if m.get("parent")}


async def eventually(check: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.2)


async def test_requests_on_adapters_match_peft(
    engine: SGLangEngine, refs: dict[str, Reference], prompt: list[int]
) -> None:
    await engine.load_adapter("a", 1, path(refs, "v1"))
    await engine.load_adapter("b", 3, path(refs, "other"))
    assert engine.adapters() == {"a": 1, "b": 3}
    for replica in replicas(engine):
        assert {"a@v1", "b@v3"} <= loaded_on(replica)
    on_a, on_b, plain = await asyncio.gather(
        run(engine, prompt, "a", on=0), run(engine, prompt, "b", on=1), run(engine, prompt, None)
    )
    check(refs["v1"], on_a)
    check(refs["other"], on_b)
    check(refs["base"], plain)
    assert set(versions_of(on_a)) == {1} and set(versions_of(on_b)) == {3}
    assert [t.token_id for t in on_a] != [t.token_id for t in plain]
    with pytest.raises(UnknownAdapterError):
        engine.generate(prompt, SamplingParams(max_tokens=2), adapter="nope")
    # Refused here, before any replica sees it: rank above the servers' limit, NaN.
    with pytest.raises(AdapterError, match="rank 32"):
        await engine.load_adapter("a", 9, path(refs, "rank32"))
    from tests.test_adapters_lora import corrupt

    nan = corrupt(Path(path(refs, "v2")), Path(path(refs, "v2")).parent / "nan", "nan")
    with pytest.raises(AdapterError, match="NaN"):
        await engine.load_adapter("a", 9, str(nan))
    assert engine.adapters() == {"a": 1, "b": 3}
    await engine.unload_adapter("b")
    with pytest.raises(UnknownAdapterError):
        engine.generate(prompt, SamplingParams(max_tokens=2), adapter="b")
    for replica in replicas(engine):
        await eventually(lambda r=replica: "b@v3" not in loaded_on(r))


async def test_two_replicas_take_a_new_version_while_streams_go_on(
    engine: SGLangEngine, refs: dict[str, Reference], prompt: list[int]
) -> None:
    await engine.load_adapter("x", 1, path(refs, "v1"))
    await engine.load_adapter("y", 1, path(refs, "other"))
    streams = [
        asyncio.create_task(run(engine, prompt, name, tokens=40, on=on))
        for name in ("x", "y")
        for on in (0, 1)
    ]
    await eventually(lambda: sum(r.running for r in replicas(engine)) == 4)
    await engine.load_adapter("x", 2, path(refs, "v2"))
    assert [r.loras.served["x"] for r in replicas(engine)] == [2, 2]
    assert not any(s.done() for s in streams)  # the load did not wait for them
    fresh = await asyncio.gather(*(run(engine, prompt, "x", on=on) for on in (0, 1)))
    for out in fresh:
        check(refs["v2"], out)
        assert set(versions_of(out)) == {2}
    for stream in streams:  # each finished on the version it started on
        out = await stream
        assert len(out) == 40 and out[-1].finish_reason == "length"
        assert set(versions_of(out)) == {1}
    for replica in replicas(engine):  # x@v1 leaves once its streams are done
        await eventually(lambda r=replica: "x@v1" not in loaded_on(r) and "x@v2" in loaded_on(r))
    assert engine.adapters() == {"x": 2, "y": 1}


async def test_a_replica_that_cannot_load_keeps_the_previous_version(
    engine: SGLangEngine, refs: dict[str, Reference], prompt: list[int]
) -> None:
    first, second = replicas(engine)
    await engine.load_adapter("r", 1, path(refs, "v1"))
    await engine.load_adapter("r", 2, path(refs, "rank16"))  # too large for the first
    assert engine.adapters() == {"r": 2}
    assert first.loras.served["r"] == 1 and second.loras.served["r"] == 2
    failed = first.loras.loads_failed
    assert failed >= 1
    on_first, on_second = await asyncio.gather(
        run(engine, prompt, "r", on=0), run(engine, prompt, "r", on=1)
    )
    assert set(versions_of(on_first)) == {1} and set(versions_of(on_second)) == {2}
    check(refs["v1"], on_first)
    check(refs["rank16"], on_second)
    await eventually(lambda: first.loras.loads_failed > failed, timeout_s=30)  # retried
    # A new adapter only the second server can take: requests go there.
    await engine.load_adapter("s", 1, path(refs, "rank16"))
    out = await run(engine, prompt, "s", on=0)
    assert set(versions_of(out)) == {1} and "s" not in first.loras.served
    check(refs["rank16"], out)
    # A version both can take: the first server catches up on `r`.
    await engine.load_adapter("r", 3, path(refs, "v2"))
    assert [r.loras.served["r"] for r in (first, second)] == [3, 3]
    await eventually(lambda: "r@v1" not in loaded_on(first) and "r@v2" not in loaded_on(second))
