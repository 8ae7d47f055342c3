"""Tokenizing rendered prompts piece by piece, with the pieces between added tokens cached.

Why: agents send the whole conversation with every request, and the chat template wraps it
in the same special tokens each time, so most of every prompt is text the server has
tokenized before: the system prompt, the tool descriptions, earlier turns. A Hugging Face
fast tokenizer first splits its input on the added tokens (`<|im_start|>` and the like) and
tokenizes the text between them independently, so the ids of a prompt are the ids of
those pieces in order. Tokenizing with the byte-level regex is the larger part of
building a prompt on a small CPU; a cached piece costs a dictionary look-up.

The split is exact only for tokenizers that work that way. `PieceEncoder.for_tokenizer`
checks the conditions (no normalizer; added tokens without stripping or word-boundary
rules; a byte-level or regex pre-tokenizer that treats every piece alike) and gives None
otherwise, and the caller tokenizes whole texts as before.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any

PIECE_PRE_TOKENIZERS = frozenset({"ByteLevel", "Split", "Digits", "Punctuation", "Whitespace"})
MAX_PIECES = 4096  # cached pieces, least recently used dropped first
MAX_PIECE_CHARS = 32_768  # longer pieces are tokenized every time, not kept


class PieceEncoder:
    """Token ids of a text as its tokenizer gives them, from cached pieces where it can.

    Not thread-safe (the cache is a plain ordered dict): the chat service uses it on the
    event loop only.
    """

    def __init__(self, backend: Any, raw_tokens: list[str], normalized_tokens: list[str]) -> None:
        self._backend = backend
        # The tokenizer extracts tokens matched on the raw text first, then the others in
        # what is left (leftmost-longest both times: longer alternatives come first here).
        self._raw = _alternation(raw_tokens)
        self._normalized = _alternation(normalized_tokens)
        self._ids = {t: backend.token_to_id(t) for t in [*raw_tokens, *normalized_tokens]}
        self._cache: OrderedDict[str, list[int]] = OrderedDict()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> PieceEncoder | None:
        """An encoder for a transformers tokenizer, or None where the split is not exact."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or backend.normalizer is not None:
            return None
        pre = backend.pre_tokenizer  # its own state only: the whole tokenizer's JSON takes ~0.2 s
        if not _pieces_independent(json.loads(pre.__getstate__()) if pre is not None else None):
            return None
        raw: list[str] = []
        normalized: list[str] = []
        for token in backend.get_added_tokens_decoder().values():
            if token.lstrip or token.rstrip or token.single_word:
                return None
            (normalized if token.normalized else raw).append(token.content)
        return cls(backend, raw, normalized)

    def encode(self, text: str) -> list[int]:
        """The ids `backend.encode(text, add_special_tokens=False)` gives."""
        ids: list[int] = []
        for piece, is_token in self._split(text):
            if is_token:
                ids.append(self._ids[piece])
            else:
                ids.extend(self._encode_piece(piece))
        return ids

    def _split(self, text: str) -> list[tuple[str, bool]]:
        out: list[tuple[str, bool]] = []
        for piece, is_token in _split_on(self._raw, text):
            out.extend([(piece, True)] if is_token else _split_on(self._normalized, piece))
        return out

    def _encode_piece(self, piece: str) -> list[int]:
        cached = self._cache.get(piece)
        if cached is not None:
            self._cache.move_to_end(piece)
            return cached
        ids: list[int] = self._backend.encode(piece, add_special_tokens=False).ids
        if len(piece) <= MAX_PIECE_CHARS:
            self._cache[piece] = ids
            if len(self._cache) > MAX_PIECES:
                self._cache.popitem(last=False)
        return ids


def _alternation(tokens: list[str]) -> re.Pattern[str] | None:
    if not tokens:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


def _split_on(pattern: re.Pattern[str] | None, text: str) -> list[tuple[str, bool]]:
    """`text` cut at every match: (piece, is_token) in order, empty pieces left out."""
    if pattern is None:
        return [(text, False)] if text else []
    out: list[tuple[str, bool]] = []
    start = 0
    for match in pattern.finditer(text):
        if match.start() > start:
            out.append((text[start : match.start()], False))
        out.append((match.group(), True))
        start = match.end()
    if start < len(text):
        out.append((text[start:], False))
    return out


def _pieces_independent(pre_tokenizer: dict[str, Any] | None) -> bool:
    """True for pre-tokenizers that treat every piece alike (Metaspace's 'first' does not)."""
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_pieces_independent(p) for p in pre_tokenizer.get("pretokenizers", []))
    return kind in PIECE_PRE_TOKENIZERS
