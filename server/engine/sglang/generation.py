"""One completion through the gateway: SGLang's `/generate` stream turned into TokenOutputs.

The prompt goes as token ids (`input_ids`), with `return_logprob`, so what is recorded is
exactly what SGLang sampled: each token's id and behaviour log-prob from
`output_token_logprobs`. Chunks may be cumulative (SGLang's default) or incremental
(`--incremental-streaming-output`); `completion_tokens` says which entries are new.
While streaming, a token carries the version label of its chunk; the final chunk's
`weight_versions` spans are authoritative and come back as `TokenOutput.versions`. A
request on a LoRA adapter runs on the adapter version its replica serves (SGLang's
`lora_path`), and its tokens carry that adapter version.

If the replica dies or aborts the request (pause mode 'abort') before it finishes, the
request continues on another replica from prompt + the tokens it already has (AReaL's
way), at most `resume_attempts` times; a request with a grammar or stop strings only
before its first token (neither a grammar's state nor a stop string straddling the cut
would survive).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from liveloop.server.engine.sglang.adapters import AdapterRollout
from liveloop.server.engine.sglang.client import ReplicaUnavailable, RequestRefused
from liveloop.server.engine.sglang.pool import Replica, ReplicaPool, parse_version
from liveloop.server.engine.types import (
    EngineError,
    InvalidRequestError,
    SamplingParams,
    TokenOutput,
)

log = logging.getLogger(__name__)


def sampling_params(params: SamplingParams, max_new: int) -> dict[str, Any]:
    """SGLang's `sampling_params` for ours (structured output as xgrammar JSON)."""
    out: dict[str, Any] = {
        "max_new_tokens": max_new,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "ignore_eos": params.ignore_eos,
        "skip_special_tokens": False,
    }
    if params.stop:
        out["stop"] = list(params.stop)
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if params.seed is not None:
        out["sampling_seed"] = params.seed
    if params.grammar is not None:
        import json

        from liveloop.server.tools.grammar import MAX_WHITESPACE, json_schema_of, tool_calls_tag

        if params.grammar.kind == "tool_calls":
            tag = tool_calls_tag(params.grammar)
        else:
            json_format = {
                "type": "json_schema",
                "json_schema": json_schema_of(params.grammar),
                "max_whitespace_cnt": MAX_WHITESPACE,
            }
            tag = {"type": "structural_tag", "format": json_format}
        out["structural_tag"] = json.dumps(tag)
    return out


def span_versions(spans: Any, count: int, fallback: list[int], base: int) -> list[int]:
    """Per-token versions of `count` tokens from SGLang's `weight_versions` spans."""
    versions = list(fallback[:count]) + [base] * max(0, count - len(fallback))
    if not isinstance(spans, list):
        return versions
    for span in spans:
        try:
            label, start, end = span["version"], int(span["start"]), int(span["end"])
        except (KeyError, TypeError, ValueError):
            continue
        parsed = parse_version(label)
        for i in range(max(0, start), min(end, count)):
            versions[i] = base if parsed is None else parsed
    return versions


class Generation:
    """Runs one request (a task), putting TokenOutputs or an exception on `queue`."""

    def __init__(
        self,
        pool: ReplicaPool,
        prompt: list[int],
        params: SamplingParams,
        max_new: int,
        request_id: str,
        affinity: str | None,
        queue: asyncio.Queue[TokenOutput | Exception],
        *,
        resume_attempts: int,
        base_version: int,
        adapter: str | None = None,
        rollout: AdapterRollout | None = None,
    ) -> None:
        self.pool = pool
        self.prompt = prompt
        self.params = params
        self.max_new = max_new
        self.request_id = request_id
        self.affinity = affinity
        self.queue = queue
        self.resume_attempts = resume_attempts
        self.base = base_version
        self.adapter = adapter
        self.rollout = rollout
        self._adapter_version: int | None = None  # of this attempt, on a LoRA adapter
        self.tokens: list[int] = []
        self.versions: list[int] = []
        self.replica: Replica | None = None
        self.rid = ""
        self._last: TokenOutput | None = None  # the finishing chunk's last token
        self._pauses = 0  # the replica's pause count when this attempt began
        self.finished = False  # its last item is on the queue
        # SGLang ignores stop_token_ids along with EOS under ignore_eos; we do not.
        self._own_stops = frozenset(params.stop_token_ids) if params.ignore_eos else frozenset()

    async def run(self) -> None:
        """Stream to the end, resuming on another replica when one fails mid-way."""
        tried: set[Replica] = set()
        attempt = 0
        try:
            while True:
                adapter = self.adapter
                replica = self.pool.pick(self.affinity, tried, adapter) or self.pool.pick(
                    self.affinity, adapter=adapter
                )
                if replica is None:
                    what = f" with adapter {adapter!r}" if adapter is not None else ""
                    raise EngineError(f"no SGLang replica{what} is available")
                try:
                    if await self._attempt(replica, attempt):
                        return
                    reason = "aborted while its replica was paused"
                except ReplicaUnavailable as exc:
                    self.pool.mark_down(replica, str(exc))
                    reason = str(exc)
                tried.add(replica)
                attempt += 1
                if not self._can_resume(attempt):
                    raise EngineError(f"the SGLang replica failed mid-request: {reason}")
                log.warning(
                    "continuing request %s on another replica (%s)", self.request_id, reason
                )
        except RequestRefused as exc:
            self._end(InvalidRequestError(f"SGLang refused the request: {exc}"))
        except Exception as exc:
            self._end(exc if isinstance(exc, EngineError) else EngineError(str(exc)))

    def _end(self, item: TokenOutput | Exception) -> None:
        self.finished = True
        self.queue.put_nowait(item)

    def _can_resume(self, attempt: int) -> bool:
        if attempt > self.resume_attempts:
            return False
        if not self.tokens:
            return True
        return self.params.grammar is None and not self.params.stop

    async def _attempt(self, replica: Replica, attempt: int) -> bool:
        """One `/generate` stream; True once finished, False if aborted (to resume)."""
        self.replica, self.rid = replica, f"{self.request_id}-{attempt}"
        self._pauses = replica.pauses
        body = {
            "input_ids": self.prompt + self.tokens,
            "sampling_params": sampling_params(self.params, self.max_new - len(self.tokens)),
            "return_logprob": True,
            "stream": True,
            "rid": self.rid,
        }
        if self.params.top_logprobs:
            body["top_logprobs_num"] = self.params.top_logprobs
        lease = None
        if self.adapter is not None and self.rollout is not None:
            lease = self.rollout.acquire(replica, self.adapter)
            if lease is None:  # picked among the replicas serving it, with no await since
                raise EngineError(f"{replica.url} does not serve adapter {self.adapter!r}")
            body["lora_path"] = lease.lora
        self._adapter_version = lease.version if lease is not None else None
        replica.running += 1
        replica.requests += 1
        offset, seen = len(self.tokens), 0
        try:
            async for chunk in replica.client.generate(body):
                meta = chunk.get("meta_info") or {}
                seen = self._take(meta, seen, offset)
                if self.finished:  # one of our own stop tokens: SGLang's request is dropped
                    await self.cancel()
                    return True
                finish = meta.get("finish_reason")
                if finish:
                    return self._finish(meta, finish, offset)
            raise ReplicaUnavailable(f"{replica.url}: the stream ended without finishing")
        except (ReplicaUnavailable, RequestRefused):
            replica.request_errors += 1
            raise
        finally:
            replica.running -= 1
            self.replica = None
            if lease is not None and self.rollout is not None:
                self.rollout.release(lease)

    def _take(self, meta: dict[str, Any], seen: int, offset: int) -> int:
        """Put this chunk's new tokens (all but the finishing one) on the queue."""
        entries = meta.get("output_token_logprobs") or []
        total = int(meta.get("completion_tokens", len(entries)))
        new = total - seen
        if new <= 0:
            self._last = None
            return seen
        fresh = entries[-new:]
        tops = (meta.get("output_top_logprobs") or [])[-new:] if self.params.top_logprobs else []
        parsed = parse_version(meta.get("weight_version"))
        version = self.base if parsed is None else parsed
        if self._adapter_version is not None:
            version = self._adapter_version
        finishing = bool(meta.get("finish_reason"))
        self._last = None
        for i, entry in enumerate(fresh):
            token = TokenOutput(
                token_id=int(entry[1]),
                logprob=float(entry[0]),
                version=version,
                top_logprobs=[(int(t[1]), float(t[0])) for t in tops[i]] if tops else [],
            )
            self.tokens.append(token.token_id)
            self.versions.append(version)
            if token.token_id in self._own_stops:
                token.finish_reason = "stop"
                token.versions = list(self.versions)
                self._end(token)
                return total
            if finishing and i == len(fresh) - 1:
                self._last = token  # finished by _finish with its reason and versions
            else:
                self.queue.put_nowait(token)
        return total

    def _finish(self, meta: dict[str, Any], finish: dict[str, Any], offset: int) -> bool:
        kind = finish.get("type")
        last, self._last = self._last, None
        if kind == "abort":
            if last is not None:  # keep it: the next attempt continues after it
                self.queue.put_nowait(last)
            message = str(finish.get("message") or "aborted")
            replica = self.replica
            if replica is not None and (
                replica.pauses != self._pauses or replica.state == "updating" or not replica.in_pool
            ):
                return False  # paused for an update (mode 'abort') or leaving: continue
            if not self.tokens:
                raise RequestRefused(message)
            raise EngineError(f"SGLang aborted the request: {message}")
        count = len(self.tokens) - offset
        if self._adapter_version is None:
            spans = meta.get("weight_versions")
            self.versions[offset:] = span_versions(spans, count, self.versions[offset:], self.base)
        matched = finish.get("matched")
        reason = "length" if kind == "length" else "stop"
        if last is None:
            log.warning("SGLang finished request %s without a final token", self.request_id)
            self._end(EngineError("SGLang finished without a final token"))
            return True
        last.finish_reason = reason
        last.stop_string = matched if isinstance(matched, str) else None
        last.versions = list(self.versions)
        self._end(last)
        return True

    async def cancel(self) -> None:
        """Ask the replica to drop the request (closing the stream usually suffices)."""
        replica, rid = self.replica, self.rid
        if replica is not None and rid:
            with contextlib.suppress(ReplicaUnavailable, RequestRefused):
                await replica.client.abort(rid)
