"""Keys/values of recently seen token sequences, reused by prompts that start with them.

Why: agent traffic is prefix-heavy. Every request of a deployment repeats the same system
prompt and tool definitions, and turn t+1 of a session is turn t's prompt + completion +
the new messages. Prefill is the costly part of serving such prompts on a CPU, so the
engine keeps the keys/values of finished prompts (and of finished prompt + completion)
and a new prompt only prefills what follows its longest cached prefix.

Entries are only valid for the weights that computed them: the engine clears the cache
on every weight swap, and does not store keys/values that span one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from server.engine.forward import Prefill


@dataclass(eq=False)
class _Entry:
    tokens: torch.Tensor  # long [L], on the CPU
    keys: list[torch.Tensor]  # per layer [1, kv_heads, >=L, head_dim]
    values: list[torch.Tensor]

    def common_prefix(self, other: torch.Tensor) -> int:
        """Length of the longest common prefix of this entry's tokens and `other`."""
        n = min(len(self.tokens), len(other))
        if n == 0:
            return 0
        differ = (self.tokens[:n] != other[:n]).nonzero()
        return int(differ[0, 0]) if len(differ) else n


class PrefixCache:
    """An LRU store of per-layer keys/values indexed by the token sequence they encode."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max(0, max_tokens)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next_id = 0
        self._tokens = 0
        self._lock = threading.Lock()

    @property
    def num_tokens(self) -> int:
        """Tokens held over all entries."""
        return self._tokens

    def clear(self) -> None:
        """Forget every entry (after a weight swap they are stale)."""
        with self._lock:
            self._entries.clear()
            self._tokens = 0

    def seed(self, state: Prefill) -> int:
        """Copy the longest cached prefix of a fresh prefill's prompt into it; returns its length.

        At least the prompt's last token is always left to run, for its logits.
        """
        if not self.max_tokens or state.done:
            return 0
        prompt = torch.tensor(state.token_ids[:-1], dtype=torch.long)
        with self._lock:
            best_id, best = -1, 0
            for entry_id, entry in self._entries.items():
                n = entry.common_prefix(prompt)
                if n > best:
                    best_id, best = entry_id, n
            if not best:
                return 0
            entry = self._entries[best_id]
            self._entries.move_to_end(best_id)
        for dst, src in zip(
            (*state.keys, *state.values), (*entry.keys, *entry.values), strict=True
        ):
            dst[:, :, :best] = src[:, :, :best]
        state.done = best
        return best

    def insert(
        self, tokens: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]
    ) -> None:
        """Remember keys/values `[1, kv_heads, >=len(tokens), head_dim]` of `tokens`.

        The tensors are kept, not copied: callers hand over buffers they no longer write.
        """
        if not tokens or len(tokens) > self.max_tokens:
            return
        new = _Entry(torch.tensor(tokens, dtype=torch.long), keys, values)
        with self._lock:
            for entry_id, entry in list(self._entries.items()):
                shared = entry.common_prefix(new.tokens)
                if shared == len(new.tokens):  # already covered by a longer or equal entry
                    self._entries.move_to_end(entry_id)
                    return
                if shared == len(entry.tokens):  # superseded by the new, longer entry
                    self._drop(entry_id)
            self._entries[self._next_id] = new
            self._next_id += 1
            self._tokens += len(tokens)
            while self._tokens > self.max_tokens:
                self._drop(next(iter(self._entries)))

    def _drop(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self._tokens -= len(entry.tokens)
