"""One sample of a chat completion as it is generated.

It keeps what the turn record needs (token ids, behaviour log-probs, versions) and turns
tokens into client text incrementally: multi-byte characters split across tokens are held
until complete, and with stop strings the last few characters are held back so that text
belonging to a stop string is never sent before the engine reports the stop.
"""

from __future__ import annotations

import time
from typing import Any

from tokenizers.decoders import DecodeStream

from liveloop.server.engine import TokenOutput


class TokenText:
    """Per-server cache of single-token strings for log-prob entries."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer
        self.special_ids = frozenset(int(i) for i in tokenizer.all_special_ids)
        self._cache: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        """The text of one token (special tokens spelled out)."""
        text = self._cache.get(token_id)
        if text is None:
            text = self.backend.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text

    def entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        """An OpenAI top-logprob entry."""
        text = self.token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


class SampleState:
    """Tokens, log-probs and text of one of a request's n samples."""

    def __init__(
        self,
        index: int,
        token_text: TokenText,
        stops: list[str],
        want_logprobs: bool,
        started_at: float,
    ) -> None:
        self.index = index
        self.token_text = token_text
        self.stops = stops
        self.want_logprobs = want_logprobs
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.started_at = started_at
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.finish_reason: str | None = None
        self.stop_string: str | None = None
        self._decoder = DecodeStream(skip_special_tokens=True)
        self._emitted: list[str] = []
        self._pending = ""
        self._lp_sent = 0

    @property
    def finished(self) -> bool:
        """True once the engine reported a finish reason (or the sample was aborted)."""
        return self.finish_reason is not None

    def add(self, out: TokenOutput) -> float:
        """Take one engine token; returns the gap since the previous token (0 for the first)."""
        now = time.perf_counter()
        gap = 0.0 if self.last_token_at is None else now - self.last_token_at
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        self.token_ids.append(out.token_id)
        self.logprobs.append(out.logprob)
        self.versions.append(out.version)
        if self.want_logprobs:
            self.top_logprobs.append(list(out.top_logprobs))
        piece = self._decoder.step(self.token_text.backend, out.token_id)
        if piece:
            self._pending += piece
        if out.versions is not None and len(out.versions) == len(self.versions):
            self.versions = list(out.versions)
        if out.finish_reason is not None:
            self._finish(out.finish_reason, out.stop_string)
        return gap

    def abort(self) -> None:
        """Mark an unfinished sample as aborted (client gone or engine failure)."""
        if self.finish_reason is None:
            self.finish_reason = "abort"

    def _finish(self, reason: str, stop_string: str | None) -> None:
        self.finish_reason = reason
        self.stop_string = stop_string
        if stop_string:
            cut = self._pending.find(stop_string)
            if cut >= 0:
                self._pending = self._pending[:cut]

    def take_text(self) -> str:
        """Text that is safe to send now (all of it once finished)."""
        if self.finished or not self.holdback:
            out, self._pending = self._pending, ""
        else:
            keep = len(self._pending) - self.holdback
            if keep <= 0:
                return ""
            out, self._pending = self._pending[:keep], self._pending[keep:]
        if out:
            self._emitted.append(out)
        return out

    @property
    def text(self) -> str:
        """All text sent or sendable so far (the final content once finished)."""
        return "".join(self._emitted) + self._pending

    def _content_token_count(self) -> int:
        n = len(self.token_ids)
        ended_on_special = (
            self.finish_reason == "stop"
            and self.stop_string is None
            and n > 0
            and self.token_ids[-1] in self.token_text.special_ids
        )
        return n - 1 if ended_on_special else n

    def take_logprobs(self) -> list[dict[str, Any]]:
        """OpenAI log-prob entries of content tokens not yet sent."""
        upto = self._content_token_count() if self.finished else len(self.token_ids)
        entries = []
        for i in range(self._lp_sent, upto):
            entry = self.token_text.entry(self.token_ids[i], self.logprobs[i])
            entry["top_logprobs"] = [self.token_text.entry(t, lp) for t, lp in self.top_logprobs[i]]
            entries.append(entry)
        self._lp_sent = max(self._lp_sent, upto)
        return entries

    def ttft(self) -> float:
        """Seconds from request arrival to this sample's first token (0 if none)."""
        return 0.0 if self.first_token_at is None else self.first_token_at - self.started_at

    def total(self) -> float:
        """Seconds from request arrival to this sample's last token (or now)."""
        end = self.last_token_at or time.perf_counter()
        return end - self.started_at
