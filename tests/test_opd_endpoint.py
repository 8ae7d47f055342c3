"""The endpoint teacher over real HTTP: prompt log-probs from a stand-in teacher server.

vLLM and SGLang cannot be installed in the test environment, so the teacher server here is a
stand-in that speaks both of their wire formats (`POST /v1/completions` with a token-id
prompt, `echo` and `logprobs`; SGLang's `POST /generate` with `input_ids`, `return_logprob`
and `input_token_logprobs`) and computes the log-probs with the real tiny-random model. The
endpoint teacher must return exactly what the same weights give in-process.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import uvicorn
from fastapi import FastAPI, Request

from liveloop.config.opd import OPDSettings, TeacherEndpoint
from liveloop.trainer.opd.distill import Distiller, TeacherSignal
from liveloop.trainer.opd.endpoint import EndpointTeacher
from liveloop.trainer.opd.teachers import TeacherItem, policy_teacher
from liveloop.trainer.policy import Policy
from liveloop.valkey import free_port
from tests.test_opd import hinted_samples
from tests.test_trainer import policy


class StandInTeacherServer:
    """Prompt log-probs of a transformers model, in vLLM's and SGLang's request forms."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.mode = "ok"  # "ok", "wrong_ids" or "slow"
        self.requests = 0
        self.port = free_port()
        app = FastAPI()
        app.post("/v1/completions")(self._completions)
        app.post("/generate")(self._generate)
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def _logprobs(self, ids: list[int]) -> list[float]:
        """log p(ids[i] | ids[:i]) for i >= 1."""
        with torch.no_grad():
            logits = self.model(torch.tensor([ids])).logits[0].float()
        logp = torch.log_softmax(logits[:-1], dim=-1)
        return logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()

    async def _answer(self, request: Request) -> dict[str, Any]:
        self.requests += 1
        if self.mode == "slow":
            await asyncio.sleep(2.0)
        return dict(await request.json())

    async def _completions(self, request: Request) -> dict[str, Any]:
        body = await self._answer(request)
        ids = list(body["prompt"])
        assert body["echo"] is True and body["logprobs"] == 0
        values: list[float | None] = [None, *self._logprobs(ids)]
        return {
            "id": "cmpl-standin",
            "object": "text_completion",
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "text": "",
                    "logprobs": {"token_logprobs": [*values, -1.0], "tokens": []},
                    "finish_reason": "length",
                }
            ],
        }

    async def _generate(self, request: Request) -> dict[str, Any]:
        body = await self._answer(request)
        ids = list(body["input_ids"])
        start = int(body["logprob_start_len"])
        values: list[float | None] = [None, *self._logprobs(ids)]
        entries = [[values[i], ids[i], None] for i in range(start, len(ids))]
        entries[0][0] = None
        if self.mode == "wrong_ids":
            entries[-1][1] = int(entries[-1][1]) + 1  # type: ignore[call-overload]
        return {"text": "", "meta_info": {"input_token_logprobs": entries}}

    def __enter__(self) -> StandInTeacherServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "stand-in teacher did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def pol() -> Policy:
    return policy()


@pytest.fixture(scope="module")
def teacher_server(pol: Policy) -> Iterator[StandInTeacherServer]:
    with StandInTeacherServer(pol.model) as server:
        yield server


def items(pol: Policy) -> list[TeacherItem]:
    distiller = Distiller(OPDSettings(), pol, policy_teacher(pol, 512, "cpu"))
    return distiller.items(hinted_samples(pol, 3), TeacherSignal())


@pytest.mark.parametrize(("api", "path"), [("completions", "/v1"), ("sglang", "")])
def test_endpoint_teacher_gives_the_same_logprobs_as_the_weights_in_process(
    pol: Policy, teacher_server: StandInTeacherServer, api: str, path: str
) -> None:
    teacher_server.mode = "ok"
    todo = items(pol)
    local = policy_teacher(pol, 512, "cpu").score(todo, time.perf_counter() + 60)
    config = TeacherEndpoint(base_url=f"http://127.0.0.1:{teacher_server.port}{path}", api=api)  # type: ignore[arg-type]
    remote = EndpointTeacher(config, "tiny-random")
    try:
        got = remote.score(todo, time.perf_counter() + 60)
    finally:
        remote.close()
    assert not got.failed and set(got.logprobs) == {i.key for i in todo}
    for item in todo:
        assert got.logprobs[item.key] == pytest.approx(local.logprobs[item.key], abs=1e-4)


def test_endpoint_failures_are_counted_not_trained(
    pol: Policy, teacher_server: StandInTeacherServer
) -> None:
    todo = items(pol)
    url = f"http://127.0.0.1:{teacher_server.port}"
    teacher_server.mode = "wrong_ids"  # the teacher scored other tokens: never used
    remote = EndpointTeacher(TeacherEndpoint(base_url=url, api="sglang"), "tiny-random")
    try:
        got = remote.score(todo, time.perf_counter() + 60)
        assert got.logprobs == {} and got.failed == {"teacher_error": 3}
        teacher_server.mode = "slow"
        started = time.perf_counter()
        got = remote.score(todo, started + 0.5)
        assert got.logprobs == {} and got.failed == {"time_budget": 3}
        assert time.perf_counter() - started < 1.9  # the budget, not the teacher, ended it
    finally:
        teacher_server.mode = "ok"
        remote.close()
    unreachable = EndpointTeacher(TeacherEndpoint(base_url=f"http://127.0.0.1:{free_port()}"), "x")
    try:
        assert unreachable.score(todo, time.perf_counter() + 10).failed == {"teacher_error": 3}
    finally:
        unreachable.close()
