"""A teacher behind HTTP: any server that returns the log-probs of a token-id prompt.

Two request forms, chosen by `trainer.opd.endpoint.api`:

- `completions` (the OpenAI legacy API, as vLLM serves it): `POST {base}/completions` with
  `prompt` = enhanced prompt ids + completion ids, `echo: true`, `logprobs: 0`,
  `max_tokens: 1`; the completion's log-probs are `choices[0].logprobs.token_logprobs` at
  the positions after the enhanced prompt.
- `sglang` (SGLang's native API): `POST {base}/generate` with `input_ids`, `return_logprob`,
  `logprob_start_len` at the last prompt token and one new token; the completion's log-probs
  are the last entries of `meta_info.input_token_logprobs` (`[logprob, token_id, ...]`),
  whose token ids are checked against the completion.

Token ids cross the wire as they are, so the teacher scores exactly the sampled tokens (the
teacher must share the policy's tokenizer). Requests run `concurrency` at a time; one that
fails or answers malformed data is counted as 'teacher_error', one the deadline cuts short
as 'time_budget'.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import httpx

from liveloop.config.opd import TeacherEndpoint
from liveloop.trainer.opd.teachers import TeacherItem, TeacherScores


class TeacherResponseError(ValueError):
    """The teacher's answer does not hold the log-probs asked for."""


def _finite(values: list[Any], n: int) -> list[float]:
    if len(values) != n:
        raise TeacherResponseError(f"expected {n} log-probs, got {len(values)}")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v > 0:
            raise TeacherResponseError(f"not a log-prob: {v!r}")
        out.append(float(v))
    return out


def completions_logprobs(body: Any, item: TeacherItem) -> list[float]:
    """The completion's log-probs out of an echoed `/completions` answer."""
    try:
        values = body["choices"][0]["logprobs"]["token_logprobs"]
    except (KeyError, IndexError, TypeError) as exc:
        raise TeacherResponseError(f"no choices[0].logprobs.token_logprobs ({exc})") from None
    start = len(item.prompt_ids)
    n = len(item.completion_ids)
    if not isinstance(values, list) or len(values) < start + n:
        raise TeacherResponseError("token_logprobs does not cover prompt and completion")
    return _finite(values[start : start + n], n)


def sglang_logprobs(body: Any, item: TeacherItem) -> list[float]:
    """The completion's log-probs out of SGLang's `input_token_logprobs`, ids checked."""
    try:
        entries = body["meta_info"]["input_token_logprobs"]
    except (KeyError, TypeError) as exc:
        raise TeacherResponseError(f"no meta_info.input_token_logprobs ({exc})") from None
    n = len(item.completion_ids)
    if not isinstance(entries, list) or len(entries) < n:
        raise TeacherResponseError("input_token_logprobs does not cover the completion")
    tail = entries[-n:]
    try:
        ids = [int(e[1]) for e in tail]
        values = [e[0] for e in tail]
    except (TypeError, IndexError, ValueError) as exc:
        raise TeacherResponseError(f"malformed input_token_logprobs entry ({exc})") from None
    if ids != item.completion_ids:
        raise TeacherResponseError("the teacher scored other tokens than the completion")
    return _finite(values, n)


class EndpointTeacher:
    """Scores hinted turns on a teacher server over HTTP."""

    name = "endpoint"

    def __init__(self, config: TeacherEndpoint, model: str) -> None:
        if not config.base_url:
            raise ValueError("the endpoint teacher needs a base_url")
        self.config = config
        self.model = config.model or model
        self.base_url = config.base_url.rstrip("/")
        self.client = httpx.Client(
            timeout=config.timeout_s,
            headers={"Authorization": f"Bearer {config.api_key}"},
            limits=httpx.Limits(max_connections=config.concurrency),
        )
        self.pool = ThreadPoolExecutor(config.concurrency, thread_name_prefix="opd-teacher")

    def request(self, item: TeacherItem) -> tuple[str, dict[str, Any]]:
        """(URL, JSON body) of the request scoring one item."""
        ids = [*item.prompt_ids, *item.completion_ids]
        if self.config.api == "sglang":
            return f"{self.base_url}/generate", {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "return_logprob": True,
                "logprob_start_len": max(len(item.prompt_ids) - 1, 0),
            }
        return f"{self.base_url}/completions", {
            "model": self.model,
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 0.0,
            "echo": True,
            "logprobs": 0,
        }

    def score_one(self, item: TeacherItem, deadline: float) -> list[float]:
        """One item's log-probs (raises on a transport error or a malformed answer)."""
        url, body = self.request(item)
        left = max(deadline - time.perf_counter(), 0.001)
        response = self.client.post(url, json=body, timeout=min(self.config.timeout_s, left))
        response.raise_for_status()
        parse = sglang_logprobs if self.config.api == "sglang" else completions_logprobs
        return parse(response.json(), item)

    def score(self, items: list[TeacherItem], deadline: float) -> TeacherScores:
        """All items, `concurrency` at a time, until the deadline."""
        out = TeacherScores()
        futures: dict[Future[list[float]], TeacherItem] = {
            self.pool.submit(self.score_one, item, deadline): item for item in items
        }
        pending = set(futures)
        while pending:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            done, pending = wait(pending, timeout=left, return_when=FIRST_COMPLETED)
            for future in done:
                try:
                    out.logprobs[futures[future].key] = future.result()
                except httpx.TimeoutException:
                    out.failed["time_budget"] += 1
                except (httpx.HTTPError, TeacherResponseError, ValueError):
                    out.failed["teacher_error"] += 1
        for future in pending:
            future.cancel()
            out.failed["time_budget"] += 1
        return out

    def close(self) -> None:
        """Stop the request threads and close the HTTP client."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.client.close()
