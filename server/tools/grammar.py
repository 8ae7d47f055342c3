"""Grammar-constrained decoding with xgrammar: forced tool calls and JSON / JSON-schema output.

`build_constraint` compiles the grammar a request needs once (`TokenConstraintFactory`); each
sample then gets its own `GrammarConstraint`, the engine's token-mask hook. The end-of-sequence
token is allowed only where the grammar is complete, and accepting it terminates the
constraint, so the engine finishes with "stop" exactly when the output is whole. Special tokens
other than end-of-sequence are never allowed: xgrammar would take them for their text.
"""

from __future__ import annotations

import json
import os
import re
import weakref
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from liveloop.server.tools.format import CALL_SEPARATOR, call_prefix, call_suffix
from liveloop.server.tools.schema import bounded_strings_as_patterns
from liveloop.server.tools.spec import (
    OutputSpec,
    ToolRequestError,
    ToolSpec,
    parse_output_spec,
    parse_tools,
)

if TYPE_CHECKING:
    import torch
    import xgrammar

# At most this many whitespace characters between JSON tokens: a weak model may otherwise
# emit whitespace until max_tokens (pretty-printing up to a few levels deep still fits).
MAX_WHITESPACE = 4
XGRAMMAR_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class ConstraintCompiler:
    """An xgrammar compiler for one tokenizer and model vocabulary size.

    Building xgrammar's tokenizer info takes a noticeable fraction of a second, so
    `for_tokenizer` keeps one compiler per live tokenizer and vocabulary size; the compiler
    itself caches compiled grammars, so a repeated schema compiles once.
    """

    _shared: ClassVar[weakref.WeakKeyDictionary[Any, dict[int, ConstraintCompiler]]] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self, tokenizer: Any, vocab_size: int | None = None) -> None:
        import torch
        import xgrammar

        self.vocab_size = vocab_size or len(tokenizer)
        eos = tokenizer.eos_token_id
        self.stop_token_ids: list[int] = [eos] if isinstance(eos, int) else []
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
        )
        self.stop_token_ids = list(info.stop_token_ids)
        threads = max(1, min(4, os.cpu_count() or 1))
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=threads)
        never = torch.zeros(self.vocab_size, dtype=torch.bool)
        for token_id, token in tokenizer.added_tokens_decoder.items():
            if token.special and token_id < self.vocab_size and token_id not in self.stop_token_ids:
                never[token_id] = True
        self.base_mask = ~never  # tokens the grammar may ever allow

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int | None = None) -> ConstraintCompiler:
        """The shared compiler of this tokenizer and vocabulary size (built on first use)."""
        size = vocab_size or len(tokenizer)
        try:
            per_size = cls._shared.setdefault(tokenizer, {})
        except TypeError:  # a tokenizer that cannot be weakly referenced: no sharing
            return cls(tokenizer, size)
        if size not in per_size:
            per_size[size] = cls(tokenizer, size)
        return per_size[size]

    def compile(self, spec: OutputSpec, param: str) -> xgrammar.CompiledGrammar:
        """The compiled grammar for an output spec; ToolRequestError naming `param` if rejected."""
        try:
            if spec.kind == "tool_calls":
                return self._compiler.compile_structural_tag(tool_calls_tag(spec))
            return self._compiler.compile_json_schema(
                json.dumps(json_schema_of(spec)),
                any_whitespace=True,
                max_whitespace_cnt=MAX_WHITESPACE,
                strict_mode=spec.schema is not None,
            )
        except (RuntimeError, ValueError, TypeError) as exc:
            message = XGRAMMAR_LOCATION.sub("", str(exc)).strip()
            raise ToolRequestError(f"schema not supported: {message}", param) from None


def json_schema_of(spec: OutputSpec) -> dict[str, Any]:
    """The JSON schema a "json" spec's output must match (any object when it names none)."""
    schema = spec.schema if spec.schema is not None else {"type": "object"}
    bounded: dict[str, Any] = bounded_strings_as_patterns(schema)
    return bounded


def tool_calls_tag(spec: OutputSpec) -> dict[str, Any]:
    """xgrammar structural tag: one (or, unless single, more) `<tool_call>` blocks.

    Plain JSON: the torch engine compiles it, the SGLang gateway sends it as SGLang's
    `structural_tag` (both use xgrammar's structural-tag format).
    """
    tags = [call_tag(tool) for tool in spec.tools]
    if spec.single_call and len(tags) == 1:
        return {"type": "structural_tag", "format": tags[0]}
    return {
        "type": "structural_tag",
        "format": {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": CALL_SEPARATOR,
            "at_least_one": True,
            "stop_after_first": spec.single_call,
        },
    }


def call_tag(tool: ToolSpec) -> dict[str, Any]:
    return {
        "type": "tag",
        "begin": call_prefix(tool.name),
        "content": {
            "type": "json_schema",
            "json_schema": bounded_strings_as_patterns(tool.parameters),
            "max_whitespace_cnt": MAX_WHITESPACE,
        },
        "end": call_suffix(),
    }


class GrammarConstraint:
    """One sample's grammar state; implements the engine's TokenConstraint protocol."""

    def __init__(
        self,
        compiled: xgrammar.CompiledGrammar,
        compiler: ConstraintCompiler,
        spec: OutputSpec | None = None,
    ) -> None:
        import torch
        import xgrammar

        # The description this grammar was compiled from: an engine in another process
        # compiles its own from it (a matcher cannot be pickled).
        self.spec = spec
        self._matcher = xgrammar.GrammarMatcher(
            compiled, override_stop_tokens=compiler.stop_token_ids or None
        )
        self._compiler = compiler
        self._bitmask = xgrammar.allocate_token_bitmask(1, compiler.vocab_size)
        self._shifts = torch.arange(32, dtype=torch.int32)

    def allowed_token_mask(self, vocab_size: int) -> torch.Tensor:
        """Bool [vocab_size]: True where the next token keeps the output valid."""
        import torch

        size = self._compiler.vocab_size
        if self._matcher.is_terminated():
            mask = torch.zeros(size, dtype=torch.bool)
            mask[self._compiler.stop_token_ids] = True
        else:
            self._matcher.fill_next_token_bitmask(self._bitmask)
            bits = (self._bitmask[0].unsqueeze(-1) >> self._shifts) & 1
            mask = bits.flatten()[:size].bool() & self._compiler.base_mask
        if vocab_size == size:
            return mask
        if vocab_size < size:
            return mask[:vocab_size].clone()
        return torch.cat([mask, torch.zeros(vocab_size - size, dtype=torch.bool)])

    def accept_token(self, token_id: int) -> None:
        """Advance past a sampled token; ValueError if the grammar does not allow it."""
        if not self._matcher.accept_token(int(token_id)):
            raise ValueError(f"token {token_id} is not allowed by the output grammar")

    def is_terminated(self) -> bool:
        """True once the output is complete and its end-of-sequence token was accepted."""
        return bool(self._matcher.is_terminated())

    def is_complete(self) -> bool:
        """True when the output so far is already a whole valid output."""
        return bool(self._matcher.is_completed())


class TokenConstraintFactory:
    """A compiled grammar for one request; `new()` gives each sample its own matcher.

    `kind` says what the grammar forces: "tool_calls" (the reply is tool calls only) or
    "json" (the reply is one JSON value).
    """

    def __init__(
        self,
        compiled: xgrammar.CompiledGrammar,
        compiler: ConstraintCompiler,
        kind: Literal["tool_calls", "json"],
        spec: OutputSpec | None = None,
    ) -> None:
        self._compiled = compiled
        self._compiler = compiler
        self.kind = kind
        self.spec = spec
        self.stop_token_ids = list(compiler.stop_token_ids)

    def new(self) -> GrammarConstraint:
        """A fresh constraint at the start of the output."""
        return GrammarConstraint(self._compiled, self._compiler, self.spec)


def build_constraint(
    tokenizer: Any,
    *,
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    response_format: dict[str, Any] | None,
    vocab_size: int | None = None,
    parallel_tool_calls: bool = True,
) -> TokenConstraintFactory | None:
    """The constraint a request needs, or None when decoding is free.

    `vocab_size` is the model's (its logits' width) when it differs from the tokenizer's
    length. Raises ToolRequestError for malformed tools, an impossible tool_choice, or a
    schema the grammar library rejects (or that no output can satisfy).
    """
    specs = parse_tools(tools)
    spec = parse_output_spec(specs, tool_choice, response_format, parallel_tool_calls)
    if spec.kind == "free":
        return None
    return compile_output(tokenizer, spec, vocab_size)


def compile_output(
    tokenizer: Any, spec: OutputSpec, vocab_size: int | None = None
) -> TokenConstraintFactory:
    """Compile a (non-free) output spec for this tokenizer; ToolRequestError if impossible."""
    param = "tools" if spec.kind == "tool_calls" else "response_format"
    compiler = ConstraintCompiler.for_tokenizer(tokenizer, vocab_size)
    kind: Literal["tool_calls", "json"] = "tool_calls" if spec.kind == "tool_calls" else "json"
    factory = TokenConstraintFactory(compiler.compile(spec, param), compiler, kind, spec)
    first = factory.new().allowed_token_mask(compiler.vocab_size)
    first[compiler.stop_token_ids] = False
    if not bool(first.any()):  # xgrammar turns e.g. {"anyOf": []} into the empty output
        raise ToolRequestError("the schema admits no value", param)
    return factory
