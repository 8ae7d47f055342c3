"""The chat completions serving class: request -> prompt ids -> engine -> reply + turn records.

Validation that needs live state (model name, token limits, the context window, tools and
grammar constraints, sessions) happens here before anything reaches the engine, so bad
input is a clear 400 and never a 5xx. Each finished (or aborted) sample becomes one
token-exact `TurnRecord` handed to the trace writer, which never delays the reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from liveloop.config import ServerConfig
from liveloop.contracts import TurnRecord, TurnType
from liveloop.server.adapters import AdapterRouting
from liveloop.server.api.chat.protocol import ChatCompletionRequest
from liveloop.server.api.chat.records import (
    FinishedSample,
    PreparedChat,
    finish_sample,
    served_sample,
    turn_record,
    usage,
)
from liveloop.server.api.chat.sample import SampleState, TokenText
from liveloop.server.api.errors import APIError, bad_request
from liveloop.server.engine import (
    ContextLengthError,
    EngineClient,
    EngineError,
    SamplingParams,
    TokenOutput,
)
from liveloop.server.metrics import ServerMetrics
from liveloop.server.prompting import BuiltPrompt, PromptBuilder
from liveloop.server.sessions import (
    PreviousTurn,
    SessionForbidden,
    SessionStore,
    SessionTurn,
    new_session_id,
)
from liveloop.server.tools import ToolRequestError
from liveloop.server.tools.spec import OutputSpec, parse_output_spec, parse_tools

SEED_MOD = 2**63


@dataclass
class RequestContext:
    """Who is calling and how the turn is to be recorded (from headers and auth)."""

    tenant: str
    session_id: str | None
    turn_type: TurnType
    record: bool
    arrival: float


def engine_error(exc: EngineError) -> APIError:
    """A 4xx for bad input the engine refused, a 503 for an engine that cannot serve."""
    if isinstance(exc, ContextLengthError):
        return bad_request(str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, ValueError):
        return bad_request(str(exc), code="invalid_value")
    return APIError(503, f"engine unavailable: {exc}", code="engine_unavailable")


class ChatService:
    """Turns validated chat requests into engine calls, replies and turn records."""

    def __init__(
        self,
        *,
        engine: EngineClient,
        tokenizer: Any,
        template: Any,
        sessions: SessionStore | None,
        submit_turn: Callable[[TurnRecord, bool], Awaitable[bool] | None],
        metrics: ServerMetrics,
        config: ServerConfig,
        model_name: str,
        model_aliases: set[str],
        capture_enabled: Callable[[], bool],
        adapters: AdapterRouting | None = None,
    ) -> None:
        self.engine = engine
        self.adapters = adapters or AdapterRouting(engine.adapters)
        self.tokenizer = tokenizer
        self.prompts = PromptBuilder(template, tokenizer)
        self.token_text = TokenText(tokenizer)
        self.sessions = sessions
        self.submit_turn = submit_turn
        self.metrics = metrics
        self.config = config
        self.model_name = model_name
        self.model_aliases = model_aliases | {model_name}
        self.capture_enabled = capture_enabled

    # Preparation ---------------------------------------------------------------------

    async def prepare(self, request: ChatCompletionRequest, ctx: RequestContext) -> PreparedChat:
        """Validate against live limits, find the turn this continues, build the prompt ids."""
        if request.model not in self.model_aliases:
            raise APIError(
                404,
                f"model {request.model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        self._check_max_tokens(request)
        messages = [m.model_dump(exclude_none=True, by_alias=True) for m in request.messages]
        tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
        grammar = self._grammar(request, tools)
        previous = await self._previous(ctx, messages)
        prompt = self._build_prompt(messages, tools, previous)
        params = self._sampling_params(request, len(prompt.token_ids), grammar)
        parse = bool(tools) and request.tool_choice != "none"
        return PreparedChat(
            request_id="chatcmpl-" + uuid.uuid4().hex,
            created=int(time.time()),
            model=self.model_name,
            request=request,
            tenant=ctx.tenant,
            turn_type=ctx.turn_type,
            record=ctx.record,
            arrival=ctx.arrival,
            messages=messages,
            tools=tools,
            parse_tools=parse,
            offered_tools=parse_tools(tools) if parse else [],
            prompt=prompt,
            params=params,
            previous=previous,
            session_hint=ctx.session_id,
            session_key=ctx.session_id
            or (previous.session_id if previous is not None else new_session_id()),
            adapter=self.adapters.for_tenant(ctx.tenant),
        )

    def _check_max_tokens(self, request: ChatCompletionRequest) -> None:
        limit = self.config.max_tokens_limit
        for name in ("max_completion_tokens", "max_tokens"):
            value = getattr(request, name)
            if value is not None and value > limit:
                raise bad_request(
                    f"{name}: {value} is over this server's limit of {limit}",
                    param=name,
                    code="invalid_value",
                )

    def _grammar(
        self, request: ChatCompletionRequest, tools: list[dict[str, Any]] | None
    ) -> OutputSpec | None:
        """What the output must be (forced tool calls, JSON), checked by the engine."""
        choice = request.tool_choice
        if choice is not None and choice != "none" and not tools:
            raise bad_request("tool_choice: needs a non-empty tools list", param="tool_choice")
        if choice is not None and not isinstance(choice, str):
            names = {t["function"]["name"] for t in tools or []}
            if choice.function.name not in names:
                raise bad_request(
                    f"tool_choice: function {choice.function.name!r} is not among the tools",
                    param="tool_choice",
                )
        fmt = request.response_format
        wire_choice: str | dict[str, Any] | None = (
            choice if choice is None or isinstance(choice, str) else choice.model_dump()
        )
        try:
            spec = parse_output_spec(
                parse_tools(tools if choice != "none" else None),
                wire_choice,
                fmt.model_dump(by_alias=True) if fmt is not None else None,
                request.parallel_tool_calls is not False,
            )
            if spec.kind == "free":
                return None
            self.engine.check_grammar(spec)
        except ToolRequestError as exc:
            raise bad_request(str(exc), param=exc.param or "tools", code="invalid_value") from None
        return spec

    async def _previous(
        self, ctx: RequestContext, messages: list[dict[str, Any]]
    ) -> PreviousTurn | None:
        if not ctx.record or self.sessions is None:
            return None
        return await self.sessions.lookup(ctx.tenant, messages, ctx.session_id)

    async def open_session(self, prep: PreparedChat) -> None:
        """Create or join the session and take the turn index (runs while the engine works).

        Called after `start`, so the Redis round trip overlaps the prefill instead of adding
        to the time to first token; a SessionForbidden then becomes a 403.
        """
        hint = prep.session_hint
        if not prep.record or self.sessions is None:
            prep.session = SessionTurn(prep.session_key, 0)
        else:
            previous = prep.previous
            try:
                prep.session = await self.sessions.allocate(prep.tenant, prep.session_key)
            except SessionForbidden as exc:
                raise APIError(
                    403, str(exc), param="X-Session-Id", code="session_forbidden"
                ) from None
            prep.session.linked = previous is not None and hint is None
        prep.headers = {
            "X-Session-Id": prep.session.session_id,
            "X-Turn-Index": str(prep.session.turn_index),
            **self.policy_headers(prep.adapter),
        }

    def policy_headers(self, adapter: str | None) -> dict[str, str]:
        """`X-Policy-Version` of the weights a request runs on, with `X-Policy-Adapter`
        naming the adapter when one serves it (its versions are its own)."""
        version = self.adapters.version_of(adapter, int(self.engine.version))
        headers = {"X-Policy-Version": str(version)}
        if adapter is not None:
            headers["X-Policy-Adapter"] = adapter
        return headers

    def _build_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        previous: PreviousTurn | None,
    ) -> BuiltPrompt:
        try:
            prompt = self.prompts.build(messages, tools, previous)
        except ToolRequestError as exc:
            raise bad_request(str(exc), param=exc.param or "messages") from None
        self.metrics.prompt_mode.labels(mode=prompt.mode).inc()
        return prompt

    def _sampling_params(
        self, request: ChatCompletionRequest, prompt_len: int, grammar: OutputSpec | None
    ) -> list[SamplingParams]:
        window = int(self.engine.max_model_len)
        room = window - prompt_len
        asked = request.requested_max_tokens
        if room <= 0 or (asked is not None and asked > room):
            want = f" + {asked} completion tokens" if asked is not None and room > 0 else ""
            raise bad_request(
                f"this model's context window is {window} tokens, but the prompt has "
                f"{prompt_len} tokens{want}; shorten the messages or lower max_tokens",
                param="messages",
                code="context_length_exceeded",
            )
        temperature = 1.0 if request.temperature is None else request.temperature
        top_p = 1.0 if request.top_p is None else request.top_p
        if top_p == 0.0:
            temperature, top_p = 0.0, 1.0
        return [
            SamplingParams(
                max_tokens=asked
                if asked is not None
                else min(self.config.default_max_tokens, room),
                temperature=temperature,
                top_p=top_p,
                seed=None if request.seed is None else (request.seed + i) % SEED_MOD,
                stop=request.stop_list,
                top_logprobs=request.top_logprobs or 0,
                grammar=grammar,
                ignore_eos=request.ignore_eos,
            )
            for i in range(request.n)
        ]

    # Generation ----------------------------------------------------------------------

    def start(
        self, prep: PreparedChat
    ) -> tuple[list[SampleState], list[AsyncIterator[TokenOutput]]]:
        """Submit every sample to the engine; errors raised up front become 4xx/503."""
        samples = [
            SampleState(
                i, self.token_text, prep.request.stop_list, prep.want_logprobs, prep.arrival
            )
            for i in range(len(prep.params))
        ]
        iterators: list[AsyncIterator[TokenOutput]] = []
        try:
            for i, params in enumerate(prep.params):
                iterators.append(
                    self.engine.generate(
                        prep.prompt.token_ids,
                        params,
                        f"{prep.request_id}-{i}",
                        affinity=prep.session_key,
                        adapter=prep.adapter,
                    )
                )
        except EngineError as exc:
            for it in iterators:
                close_soon(it)
            raise engine_error(exc) from None
        prep.submitted = time.perf_counter()
        self.metrics.prompt_tokens.inc(len(prep.prompt.token_ids) * len(samples))
        self.metrics.count_adapter_request(prep.adapter)
        return samples, iterators

    def observe(self, sample: SampleState, out: TokenOutput) -> None:
        """Feed one token to its sample and the latency metrics."""
        gap = sample.add(out)
        if gap:
            self.metrics.inter_token.observe(gap)
        else:
            self.metrics.ttft.observe(sample.ttft())

    async def complete(self, prep: PreparedChat) -> dict[str, Any]:
        """Generate every sample to the end and build the chat.completion body."""
        samples, iterators = self.start(prep)

        async def collect(sample: SampleState, it: AsyncIterator[TokenOutput]) -> None:
            async for out in it:
                self.observe(sample, out)
                sample.take_text()

        try:
            await self.open_session(prep)
            await asyncio.gather(
                *(collect(s, it) for s, it in zip(samples, iterators, strict=True))
            )
        except EngineError as exc:
            raise engine_error(exc) from None
        finally:
            for it in iterators:
                await close_iterator(it)
            for s in samples:
                s.abort()
        finished = [finish_sample(s, prep.parse_tools, prep.offered_tools) for s in samples]
        await self.finalize(prep, samples, finished)
        return self._body(prep, samples, finished)

    def _body(
        self, prep: PreparedChat, samples: list[SampleState], finished: list[FinishedSample]
    ) -> dict[str, Any]:
        choices = []
        for sample, done in zip(samples, finished, strict=True):
            logprobs = {"content": sample.take_logprobs()} if prep.want_logprobs else None
            choices.append(
                {
                    "index": sample.index,
                    "message": done.message,
                    "logprobs": logprobs,
                    "finish_reason": done.finish_reason,
                }
            )
        return {
            "id": prep.request_id,
            "object": "chat.completion",
            "created": prep.created,
            "model": prep.model,
            "choices": choices,
            "usage": usage(prep, samples),
            "system_fingerprint": f"liveloop-v{self.engine.version}",
        }

    async def finalize(
        self,
        prep: PreparedChat,
        samples: list[SampleState],
        finished: list[FinishedSample],
        remember: bool = True,
    ) -> None:
        """Metrics, turn records (unless opted out or paused) and the session index.

        With `remember` (the reply is about to end), waits up to `trace_durable_wait_s` for
        the records to be durable, so a reply a client saw is a record that survives a crash.
        """
        for sample, done in zip(samples, finished, strict=True):
            self.metrics.completion_tokens.inc(len(sample.token_ids))
            self.metrics.e2e.observe(sample.total())
            self.metrics.requests.labels(finish_reason=done.finish_reason).inc()
        if not prep.record:
            return
        if self.capture_enabled():
            queued = max(0.0, prep.submitted - prep.arrival)
            wait = remember and self.config.trace_durable_wait_s > 0
            waiters = []
            for sample, done in zip(samples, finished, strict=True):
                waiter = self.submit_turn(turn_record(prep, sample, done, queued), wait)
                if waiter is not None:
                    waiters.append(waiter)
            if waiters:
                await asyncio.wait(
                    [asyncio.ensure_future(w) for w in waiters],
                    timeout=self.config.trace_durable_wait_s,
                )
        if remember and self.sessions is not None:
            served = [
                served_sample(prep, s, d)
                for s, d in zip(samples, finished, strict=True)
                if d.finish_reason != "abort"
            ]
            await self.sessions.remember(
                prep.tenant, prep.turn.session_id, prep.turn.turn_index, prep.messages, served
            )


def close_soon(it: AsyncIterator[Any]) -> None:
    """Close an engine iterator from synchronous code (frees its slot)."""
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        task = asyncio.ensure_future(aclose())
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)


async def close_iterator(it: AsyncIterator[Any]) -> None:
    """Close an engine iterator (frees its slot); a no-op when it has finished."""
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()
