"""Token-exact prompt building for follow-up turns.

Training must see exactly the tokens that were sampled. When a request continues an earlier
served sample, re-rendering the whole conversation would re-tokenise the sampled reply (and
could split it differently), so instead the prompt becomes the previous prompt ids + the
sampled completion ids + the ids of the new part only, provided the chat template makes the
text of that equal to a fresh render. Otherwise the fresh render is used. Which one
happened is recorded in each turn as `prompt_mode`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from liveloop.server.sessions import PreviousTurn


class ChatTemplateLike(Protocol):
    """What the prompt builder needs from the tools module's ChatTemplate."""

    def render_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool = True,
    ) -> list[int]: ...

    def render_text(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool = True,
    ) -> str: ...

    def encode(self, text: str) -> list[int]: ...


@dataclass
class BuiltPrompt:
    """Prompt ids as the engine will see them, and how they were obtained."""

    token_ids: list[int]
    mode: Literal["fresh", "extended"]


class PromptBuilder:
    """Builds prompt ids for a request, extending the previous turn's ids when exact."""

    def __init__(self, template: ChatTemplateLike, tokenizer: Any) -> None:
        self.template = template
        self.tokenizer = tokenizer

    def build(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        previous: PreviousTurn | None,
    ) -> BuiltPrompt:
        """Extended prompt when the template allows it, else the fresh render."""
        if previous is not None:
            extended = self._extend(messages, tools, previous)
            if extended is not None:
                return BuiltPrompt(extended, "extended")
        return BuiltPrompt(self.template.render_ids(messages, tools), "fresh")

    def _extend(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        previous: PreviousTurn,
    ) -> list[int] | None:
        served = [*previous.prompt_token_ids, *previous.completion_token_ids]
        if not previous.completion_token_ids:
            return None
        served_text = self.decode(served)
        fresh_text = self.template.render_text(messages, tools)
        if not fresh_text.startswith(served_text) or len(fresh_text) == len(served_text):
            return None
        new_part = fresh_text[len(served_text) :]
        new_ids = self.template.encode(new_part)
        if self.decode(new_ids) != new_part:  # the tokenizer must round-trip the new part
            return None
        return served + list(new_ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Exact text of token ids, special tokens included, no clean-up."""
        return str(
            self.tokenizer.decode(
                list(token_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        )
