"""Token-by-token Server-Sent Events for `stream: true`.

Each engine token becomes a `chat.completion.chunk` as soon as it is produced (text held
back only while it may still turn out to be part of a stop string or an incomplete
character); tool calls stream as `tool_calls` deltas. If the client goes away, the response
task is cancelled or the body iterator is closed: either way the engine iterators are
closed, which frees their slots at once, and the aborted samples are still recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Send

from liveloop.server.api.chat.records import (
    TRUNCATED,
    PreparedChat,
    finish_sample,
    reply_finish_reason,
    usage,
)
from liveloop.server.api.chat.sample import SampleState
from liveloop.server.api.chat.serving import ChatService, close_iterator, engine_error
from liveloop.server.engine import EngineError, TokenOutput
from liveloop.server.tools import StreamingToolCallParser

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
DONE_BYTES = DONE.encode()


class SSEResponse(StreamingResponse):
    """A streaming response that ends with its last event and always closes its body iterator.

    The body iterator yields whole SSE events, several joined where they are produced
    together; the one ending in `data: [DONE]` goes out with the end of the response in
    the same write. Each write wakes the client, so fewer writes leave the CPU to the
    engine (on a small machine the engine, the server and the client share a few cores).
    """

    async def stream_response(self, send: Send) -> None:
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            async for chunk in self.body_iterator:
                body = chunk.encode() if isinstance(chunk, str) else bytes(chunk)
                last = body.endswith(DONE_BYTES)
                await send({"type": "http.response.body", "body": body, "more_body": not last})
                if last:
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


class ChatStream:
    """The SSE event stream of one prepared request."""

    def __init__(self, service: ChatService, prep: PreparedChat) -> None:
        self.service = service
        self.prep = prep
        self.samples, self.iterators = service.start(prep)
        self.parsers = [
            StreamingToolCallParser(prep.offered_tools) if prep.parse_tools else None
            for _ in self.samples
        ]
        self.called_tool = [False for _ in self.samples]
        self._head = (
            f'{{"id":"{prep.request_id}","object":"chat.completion.chunk",'
            f'"created":{prep.created},"model":{json.dumps(prep.model)},"choices":'
        )
        self._finalized = False

    def _event(self, choices: list[dict[str, Any]], extra: str = "") -> str:
        return f"data: {self._head}{json.dumps(choices, ensure_ascii=False)}{extra}}}\n\n"

    async def events(self) -> AsyncIterator[str]:
        """The SSE events: a role chunk, token deltas, finish chunks, usage, [DONE].

        The role chunk goes out with the first token (or error), so the client is woken
        once for both; the events of one engine step go out together.
        """
        role = [self._choice(s.index, {"role": "assistant", "content": ""}) for s in self.samples]
        head = self._event(role)
        try:
            async with contextlib.aclosing(self._tokens()) as tokens:
                async for sample, out in tokens:
                    self.service.observe(sample, out)
                    events = self._sample_events(sample)
                    if events:
                        yield head + "".join(events)
                        head = ""
            await self._finalize(remember=True)
            tail = ""
            if self.prep.request.stream_options and self.prep.request.stream_options.include_usage:
                tail = self._event([], f',"usage":{json.dumps(usage(self.prep, self.samples))}')
            yield head + tail + DONE
        except EngineError as exc:
            yield head + "data: " + json.dumps(engine_error(exc).body()) + "\n\n" + DONE
        finally:
            with anyio.CancelScope(shield=True):
                await self._close()

    def _choice(
        self, index: int, delta: dict[str, Any], logprobs: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        return {
            "index": index,
            "delta": delta,
            "logprobs": None if logprobs is None else {"content": logprobs},
            "finish_reason": None,
        }

    def _content_event(self, index: int, text: str) -> str:
        """The common case, formatted without building dicts: a plain text delta."""
        content = json.dumps(text, ensure_ascii=False)
        return (
            f'data: {self._head}[{{"index":{index},"delta":{{"content":{content}}},'
            f'"logprobs":null,"finish_reason":null}}]}}\n\n'
        )

    def _sample_events(self, sample: SampleState) -> list[str]:
        text = sample.take_text()
        parser = self.parsers[sample.index]
        if parser is None and not sample.finished and not self.prep.want_logprobs:
            return [self._content_event(sample.index, text)] if text else []
        if parser is None:
            deltas = [{"content": text}] if text else []
        else:
            deltas = parser.feed(text) if text else []
            if sample.finished:
                deltas += parser.finish(truncated=sample.finish_reason in TRUNCATED)
        if any("tool_calls" in d for d in deltas):
            self.called_tool[sample.index] = True
        want_lp = self.prep.want_logprobs and (deltas or sample.finished)
        logprobs = sample.take_logprobs() if want_lp else None
        events = []
        for i, delta in enumerate(deltas):
            events.append(
                self._event([self._choice(sample.index, delta, logprobs if i == 0 else None)])
            )
        if sample.finished:
            final = self._choice(sample.index, {}, logprobs if not deltas else None)
            final["finish_reason"] = reply_finish_reason(
                sample.finish_reason, self.called_tool[sample.index]
            )
            events.append(self._event([final]))
        return events

    async def _tokens(self) -> AsyncGenerator[tuple[SampleState, TokenOutput], None]:
        if len(self.iterators) == 1:
            sample = self.samples[0]
            async for out in self.iterators[0]:
                yield sample, out
            return
        queue: asyncio.Queue[tuple[int, TokenOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, it: AsyncIterator[TokenOutput]) -> None:
            try:
                async for out in it:
                    queue.put_nowait((i, out))
            except Exception as exc:
                queue.put_nowait((i, exc))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(self.iterators)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield self.samples[i], item
        finally:
            for task in tasks:
                task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _finalize(self, remember: bool) -> None:
        if self._finalized:
            return
        self._finalized = True
        for sample in self.samples:
            sample.abort()
        finished = []
        for sample in self.samples:
            done = finish_sample(sample, self.prep.parse_tools, self.prep.offered_tools)
            done.finish_reason = reply_finish_reason(
                sample.finish_reason,
                self.called_tool[sample.index] or done.finish_reason == "tool_calls",
            )
            finished.append(done)
        await self.service.finalize(self.prep, self.samples, finished, remember=remember)

    async def _close(self) -> None:
        for it in self.iterators:
            await close_iterator(it)
        try:
            await self._finalize(remember=False)
        except Exception:  # never let record keeping turn a disconnect into an error
            log.exception("could not record aborted request %s", self.prep.request_id)


async def stream_response(service: ChatService, prep: PreparedChat) -> SSEResponse:
    """Start the samples (errors up front become 4xx/503), open the session, stream events."""
    stream = ChatStream(service, prep)
    try:
        await service.open_session(prep)
    except BaseException:
        for it in stream.iterators:
            await close_iterator(it)
        raise
    headers = dict(prep.headers)
    headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return SSEResponse(stream.events(), media_type="text/event-stream", headers=headers)
