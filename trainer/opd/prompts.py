"""Enhanced prompts: a turn's own prompt ids with a directive hint inserted, token-exactly.

The teacher must score exactly the tokens the policy sampled, after exactly the prompt the
policy saw plus the hint. So the enhanced prompt is never a re-tokenised conversation: it is
the recorded prompt ids, split where the chat template's generation prompt (the assistant
header, `<|im_start|>assistant\\n` for ChatML) begins, with the ids of one extra message
inserted there, rendered the way the template renders a message in that place. The
completion ids are not touched.

The insertion is checked before it is used: the recorded prompt must decode to the template's
render of the turn's messages (or, for a prompt the server extended token-exactly, to a
render whose text after the last assistant message is the template's own: the replies
before it are as the model wrote them, a call perhaps not in the template's form, see
`server/prompting.py`), end with the generation prompt's ids, and the extra message's text
must be what the template adds for it and survive tokenisation unchanged. A template that
renders differently (one that rejects a message in that place, or changes earlier text
because of it) gives no enhanced prompt, and the turn is trained without OPD.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from liveloop.server.tools.spec import ToolRequestError
from liveloop.server.tools.template import ChatTemplate, last_reply_index

Failure = Literal["template", "mismatch"]


@dataclass(frozen=True)
class Enhanced:
    """An enhanced prompt, or why there is none (`ids` None, `failure` set)."""

    ids: list[int] | None
    failure: Failure | None = None


class HintInserter:
    """Inserts a hint message before the assistant's reply, in a turn's own prompt ids."""

    def __init__(
        self,
        tokenizer: Any,
        role: str = "system",
        template_text: str = "{hint}",
        tool_result_reminder: str = "",
    ) -> None:
        self.tokenizer = tokenizer
        self.template = ChatTemplate(tokenizer, tool_result_reminder)  # renders as served
        self.role = role
        self.template_text = template_text

    def message(self, hint: str) -> dict[str, str]:
        """The extra message the hint is rendered as."""
        return {"role": self.role, "content": self.template_text.replace("{hint}", hint)}

    def decode(self, ids: Sequence[int]) -> str:
        """Exact text of token ids, special tokens included, no clean-up."""
        return str(
            self.tokenizer.decode(
                list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        )

    def insert(
        self,
        prompt_ids: Sequence[int],
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        hint: str,
    ) -> Enhanced:
        """The enhanced prompt ids; `failure` says why there are none.

        'template': the chat template cannot render the hint as an extra message exactly
        (it rejects it, or it changes the text before it). 'mismatch': the recorded prompt
        ids are not the template's render of these messages.
        """
        render = self.template.render_text
        try:
            plain = render(messages, tools, add_generation_prompt=False)
            full = render(messages, tools, add_generation_prompt=True)
            hinted = render([*messages, self.message(hint)], tools, add_generation_prompt=False)
            hinted_full = render([*messages, self.message(hint)], tools, add_generation_prompt=True)
        except ToolRequestError:
            return Enhanced(None, "template")
        if not (full.startswith(plain) and hinted.startswith(plain)):
            return Enhanced(None, "template")
        header, extra = full[len(plain) :], hinted[len(plain) :]
        if not extra or hinted_full != plain + extra + header:
            return Enhanced(None, "template")
        extra_ids = self.template.encode(extra)
        if self.decode(extra_ids) != extra:
            return Enhanced(None, "template")
        ids = list(prompt_ids)
        cut = len(ids)
        if header:
            header_ids = self.template.encode(header)
            cut = len(ids) - len(header_ids)
            if cut < 0 or ids[cut:] != header_ids:
                return Enhanced(None, "mismatch")
        if not self._renders(self.decode(ids), messages, tools, full):
            return Enhanced(None, "mismatch")
        return Enhanced(ids[:cut] + extra_ids + ids[cut:])

    def _renders(
        self,
        text: str,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        full: str,
    ) -> bool:
        """Whether a recorded prompt's `text` is these messages' render `full`, or a prompt
        the server extended token-exactly: the same text after the last assistant message
        (what the hint goes at the end of), the assistant replies before it as sampled."""
        if text == full:
            return True
        last = last_reply_index(messages)
        if last < 0:
            return False
        try:
            through = self.template.render_text(
                messages[: last + 1], tools, add_generation_prompt=False
            )
        except ToolRequestError:  # a template that will not end on an assistant message
            return False
        tail = full[len(through) :]
        return (
            full.startswith(through)
            and bool(tail)
            and len(text) > len(tail)
            and text.endswith(tail)
        )
