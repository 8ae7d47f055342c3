"""The prefix cache's block index: longest reuse, coverage, supersession and eviction."""

from __future__ import annotations

import torch

from liveloop.server.engine.forward import Prefill
from liveloop.server.engine.prefix_cache import BLOCK_TOKENS, PrefixCache


def kv(tokens: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One layer of keys/values whose every column holds its token id (easy to check)."""
    col = torch.tensor(tokens, dtype=torch.float32)[None, None, :, None]
    return [col.clone()], [col.clone() + 0.5]


def seeded(cache: PrefixCache, prompt: list[int]) -> tuple[int, Prefill]:
    state = Prefill(
        prompt, [torch.zeros(1, 1, len(prompt), 1)], [torch.zeros(1, 1, len(prompt), 1)]
    )
    return cache.seed(state), state


def test_longest_prefix_among_many_entries_sharing_a_system_prompt() -> None:
    cache = PrefixCache(max_tokens=100_000)
    system = list(range(1000, 1040))  # 40 tokens: two whole blocks and a partial one
    for user in range(200):
        tokens = [*system, 5000 + user, *range(7000, 7030)]
        cache.insert(tokens, *kv(tokens))
    assert cache.num_entries == 200
    prompt = [*system, 5000 + 123, *range(7000, 7010), 9, 9]
    hit, state = seeded(cache, prompt)
    assert hit == len(system) + 1 + 10  # exact, not rounded down to a block boundary
    assert state.done == hit
    assert state.keys[0][0, 0, :hit, 0].tolist() == [float(t) for t in prompt[:hit]]
    assert state.values[0][0, 0, :hit, 0].tolist() == [t + 0.5 for t in prompt[:hit]]
    other, _ = seeded(cache, [*system, 1, 2, 3])
    assert other == len(system)  # the shared system prompt, from whichever entry
    assert seeded(cache, list(range(BLOCK_TOKENS - 1)))[0] == 0  # shorter than a block


def test_covered_and_superseded_entries() -> None:
    cache = PrefixCache(max_tokens=100_000)
    prompt = list(range(100, 140))
    cache.insert(prompt, *kv(prompt))
    turn = [*prompt, *range(300, 330)]  # prompt + completion supersedes the prompt
    cache.insert(turn, *kv(turn))
    assert cache.num_entries == 1 and cache.num_tokens == len(turn)
    cache.insert(prompt[:35], *kv(prompt[:35]))  # covered by the longer entry
    assert cache.num_entries == 1
    assert seeded(cache, [*turn, 1])[0] == len(turn)


def test_eviction_keeps_the_index_consistent() -> None:
    cache = PrefixCache(max_tokens=100)
    first = list(range(0, 60))
    second = list(range(500, 560))
    cache.insert(first, *kv(first))
    cache.insert(second, *kv(second))  # over budget: the first entry goes
    assert cache.num_entries == 1 and cache.num_tokens == 60
    assert seeded(cache, [*first, 1])[0] == 0
    assert seeded(cache, [*second, 1])[0] == 60
    cache.clear()
    assert seeded(cache, [*second, 1])[0] == 0 and cache.num_tokens == 0
