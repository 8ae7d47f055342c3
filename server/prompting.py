"""Token-exact prompt building for follow-up turns.

Training must see exactly the tokens that were sampled. When a request continues an earlier
served sample, re-rendering the whole conversation would re-tokenise the sampled reply (and
could split it differently), so instead the prompt becomes the previous prompt ids + the
sampled completion ids + the ids of the new part only, provided the chat template makes the
text of that equal to a fresh render. Otherwise the fresh render is used. Which one
happened is recorded in each turn as `prompt_mode`.

A reply that the server turned into `tool_calls` comes back from the client as structured
calls, which the chat template writes its own way (Qwen's: `<tool_call>` blocks), while the
model may have written the call otherwise (a fenced JSON object). A fresh render would then
put a call the model never wrote into the prompt, and into the turn that training sees. So
a follow-up to such a reply is extended too: the model's own sampled call, then what the
template puts after that reply (its tool results, a user message), exactly as a fresh
render would. The same holds for every later turn of the session, whose served prompt
still holds that call: the previous sample is found by a hash of the messages up to its
reply (`server/sessions.py`), so what came before it is the conversation that was served,
however the template would render it now.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from liveloop.server.sessions import PreviousTurn
from liveloop.server.tools.template import last_reply_index


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
        if fresh_text.startswith(served_text) and len(fresh_text) > len(served_text):
            new_part: str | None = fresh_text[len(served_text) :]
        else:
            new_part = self._after_sampled_reply(messages, tools, previous, fresh_text)
        if not new_part:
            return None
        new_ids = self.template.encode(new_part)
        if self.decode(new_ids) != new_part:  # the tokenizer must round-trip the new part
            return None
        return served + list(new_ids)

    def _after_sampled_reply(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        previous: PreviousTurn,
        fresh_text: str,
    ) -> str | None:
        """The text after the previous reply (`previous.reply_index`, else the last
        assistant message) when it ended its turn with a special token: what the template
        writes after that token, then the rest of the fresh render. None when the template's
        own rendering of the conversation does not split there, or renders a text reply
        otherwise than it was sampled."""
        k = previous.reply_index if previous.reply_index is not None else last_reply_index(messages)
        if not 0 <= k < len(messages) - 1 or messages[k].get("role") != "assistant":
            return None
        end_id = previous.completion_token_ids[-1]
        if end_id not in set(getattr(self.tokenizer, "all_special_ids", ())):
            return None  # the sample was cut off (max_tokens): it never ended its turn
        head = self.template.render_text(messages[:k], tools)
        through = self.template.render_text(messages[: k + 1], tools, add_generation_prompt=False)
        if not through.startswith(head) or not fresh_text.startswith(through):
            return None
        reply, end = through[len(head) :], self.decode([end_id])
        if end not in reply:
            return None
        cut = reply.rindex(end) + len(end)
        sampled = self.decode(previous.completion_token_ids)
        if not messages[k].get("tool_calls") and not reply[:cut].endswith(sampled):
            return None
        return reply[cut:] + fresh_text[len(through) :]

    def decode(self, token_ids: Sequence[int]) -> str:
        """Exact text of token ids, special tokens included, no clean-up."""
        return str(
            self.tokenizer.decode(
                list(token_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        )
