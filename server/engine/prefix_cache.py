"""Keys/values of recently seen token sequences, reused by prompts that start with them.

Why: agent traffic is prefix-heavy. Every request of a deployment repeats the same system
prompt and tool definitions, and turn t+1 of a session is turn t's prompt + completion +
the new messages. Prefill is the costly part of serving such prompts on a CPU, so the
engine keeps the keys/values of finished prompts (and of finished prompt + completion)
and a new prompt only prefills what follows its longest cached prefix.

Entries are only valid for the weights that computed them: the engine clears the cache
on every weight swap, and does not store keys/values that span one. Requests on LoRA
adapters store and find entries under a namespace of their own (the adapter and its
version), so no adapter ever reuses keys/values another one (or the base) computed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from liveloop.server.engine.forward import Prefill

BLOCK_TOKENS = 16


def block_keys(tokens: list[int], namespace: Hashable = None) -> list[int]:
    """A chain hash of every whole `BLOCK_TOKENS` block: `keys[i]` covers blocks 0..i.

    Equal keys mean equal prefixes (in the same namespace) up to a hash collision, which
    lookups rule out by an exact comparison with the entry they found.
    """
    keys: list[int] = []
    key = 0 if namespace is None else hash(namespace)
    for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        key = hash((key, *tokens[start : start + BLOCK_TOKENS]))
        keys.append(key)
    return keys


@dataclass(eq=False)
class _Entry:
    tokens: torch.Tensor  # long [L], on the CPU
    keys: list[torch.Tensor]  # per layer [1, kv_heads, >=L, head_dim]
    values: list[torch.Tensor]
    blocks: list[int]  # block_keys of the tokens
    namespace: Hashable = None

    def common_prefix(self, other: torch.Tensor, namespace: Hashable = None) -> int:
        """Length of the longest common prefix of this entry's tokens and `other`."""
        if namespace != self.namespace:
            return 0
        n = min(len(self.tokens), len(other))
        if n == 0:
            return 0
        differ = (self.tokens[:n] != other[:n]).nonzero()
        return int(differ[0, 0]) if len(differ) else n


class PrefixCache:
    """An LRU store of per-layer keys/values indexed by the token sequence they encode.

    Entries are found through a hash index of their whole 16-token blocks, so a lookup
    or an insert costs a few dictionary probes and one exact comparison, however many
    entries there are (a linear scan cost milliseconds per request with ~100 entries).
    Prefixes shorter than one block are not reused.
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max(0, max_tokens)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._by_block: dict[int, dict[int, None]] = {}  # block key -> ids, oldest first
        self._by_last_block: dict[int, dict[int, None]] = {}  # an entry's last block key
        self._next_id = 0
        self._tokens = 0
        self._lock = threading.Lock()

    @property
    def num_tokens(self) -> int:
        """Tokens held over all entries."""
        return self._tokens

    @property
    def num_entries(self) -> int:
        """Entries held."""
        return len(self._entries)

    def clear(self) -> None:
        """Forget every entry (after a weight swap they are stale)."""
        with self._lock:
            self._entries.clear()
            self._by_block.clear()
            self._by_last_block.clear()
            self._tokens = 0

    def _longest(
        self, blocks: list[int], tokens: torch.Tensor, namespace: Hashable
    ) -> tuple[int, int]:
        """(entry id, common prefix length) of the entry sharing most whole blocks."""
        for key in reversed(blocks):
            ids = self._by_block.get(key)
            if ids:
                entry_id = next(reversed(ids))
                return entry_id, self._entries[entry_id].common_prefix(tokens, namespace)
        return -1, 0

    def seed(self, state: Prefill, namespace: Hashable = None) -> int:
        """Copy the longest cached prefix of a fresh prefill's prompt into it; returns its length.

        At least the prompt's last token is always left to run, for its logits. Only
        entries stored under the same `namespace` (weights) are used.
        """
        if not self.max_tokens or state.done:
            return 0
        ids = state.token_ids[:-1]
        prompt = torch.tensor(ids, dtype=torch.long)
        with self._lock:
            best_id, best = self._longest(block_keys(ids, namespace), prompt, namespace)
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
        self,
        tokens: list[int],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        namespace: Hashable = None,
    ) -> None:
        """Remember keys/values `[1, kv_heads, >=len(tokens), head_dim]` of `tokens`.

        The tensors are kept, not copied: callers hand over buffers they no longer write.
        """
        if not tokens or len(tokens) > self.max_tokens:
            return
        ids = torch.tensor(tokens, dtype=torch.long)
        new = _Entry(ids, keys, values, block_keys(tokens, namespace), namespace)
        if not new.blocks:
            return
        with self._lock:
            covering, shared = self._longest(new.blocks[-1:], new.tokens, namespace)
            if shared == len(tokens):  # already covered by a longer or equal entry
                self._entries.move_to_end(covering)
                return
            self._drop_superseded(new)
            entry_id = self._next_id
            self._next_id += 1
            self._entries[entry_id] = new
            for key in new.blocks:
                self._by_block.setdefault(key, {})[entry_id] = None
            self._by_last_block.setdefault(new.blocks[-1], {})[entry_id] = None
            self._tokens += len(tokens)
            while self._tokens > self.max_tokens:
                self._drop(next(iter(self._entries)))

    def _drop_superseded(self, new: _Entry) -> None:
        """Drop entries whose tokens are a prefix of the new entry's (it covers them)."""
        candidates = {i for key in new.blocks for i in self._by_last_block.get(key, ())}
        for entry_id in candidates:
            entry = self._entries[entry_id]
            if len(entry.tokens) <= len(new.tokens) and (
                entry.common_prefix(new.tokens, new.namespace) == len(entry.tokens)
            ):
                self._drop(entry_id)

    def _drop(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self._tokens -= len(entry.tokens)
        for index, key in [(self._by_block, k) for k in entry.blocks] + [
            (self._by_last_block, entry.blocks[-1])
        ]:
            ids = index.get(key)
            if ids is not None:
                ids.pop(entry_id, None)
                if not ids:
                    del index[key]
