"""The batched sampler on hand-made logits: the right distribution, per-row seeds, masks."""

from __future__ import annotations

import math

import pytest
import torch

from liveloop.server.engine import SamplingParams
from liveloop.server.engine.sampling import draw, sample_batch


def seeded(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def test_draw_matches_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2])
    generator = seeded(0)
    n = 4000
    counts = [0] * 4
    for _ in range(n):
        counts[draw(probs[None].clone(), [generator])[0]] += 1
    assert counts[1] == 0  # a zero-probability token is never drawn
    for token, p in ((0, 0.5), (2, 0.3), (3, 0.2)):
        sd = math.sqrt(n * p * (1 - p))
        assert abs(counts[token] - n * p) < 4 * sd, counts


def test_draw_unnormalised_rows_and_the_rounding_edge(monkeypatch: pytest.MonkeyPatch) -> None:
    probs = torch.tensor([[0.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    assert draw(probs.clone(), [None, None]) == [1, 0]
    # u * total can round up to the total itself: the last token with any mass must come
    # back, never an index past the vocabulary or a zero-mass token after it.
    monkeypatch.setattr(torch, "rand", lambda n, **_: torch.ones(n))
    assert draw(torch.tensor([[0.25, 0.75, 0.0, 0.0]]), [None]) == [1]


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch() -> None:
    logits = torch.randn(5, 300, generator=seeded(1))
    params = [SamplingParams(max_tokens=1, temperature=0.9, seed=s) for s in range(5)]
    alone = sample_batch(logits[2:3], params[2:3], [seeded(2)])
    together = sample_batch(logits, params, [seeded(s) for s in range(5)])
    assert alone[0] == together[2]


def test_greedy_mixed_with_sampled_and_raw_logprobs() -> None:
    logits = torch.randn(3, 50, generator=seeded(3))
    params = [
        SamplingParams(max_tokens=1, temperature=0.0),
        SamplingParams(max_tokens=1, temperature=2.0, seed=1),
        SamplingParams(max_tokens=1, temperature=0.0, top_logprobs=2),
    ]
    out = sample_batch(logits, params, [None, seeded(1), None])
    raw = torch.log_softmax(logits, dim=-1)
    assert not isinstance(out[0], Exception) and not isinstance(out[2], Exception)
    assert out[0].token_id == int(logits[0].argmax())
    assert out[2].token_id == int(logits[2].argmax())
    assert [t for t, _ in out[2].top_logprobs] == raw[2].topk(2).indices.tolist()
    for row, sampled in enumerate(out):
        assert not isinstance(sampled, Exception)
        assert math.isclose(sampled.logprob, float(raw[row, sampled.token_id]), rel_tol=1e-5)


class OnlyTokens:
    """A grammar hook that allows a fixed set of tokens."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def allowed_token_mask(self, vocab_size: int) -> torch.Tensor:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[self.allowed] = True
        return mask

    def accept_token(self, token_id: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False


@pytest.mark.parametrize("temperature", [1e-308, 1e-45, 1e-6])
def test_a_tiny_temperature_picks_the_best_allowed_token(temperature: float) -> None:
    """Found by the schema fuzzer: logits / 1e-308 are +-inf, and their softmax was NaN,
    so a grammar-constrained request failed with a 503."""
    logits = torch.randn(2, 40, generator=seeded(4)) * 5
    allowed = [3, 17, 29]
    params = [
        SamplingParams(max_tokens=1, temperature=temperature, constraint=OnlyTokens(allowed)),
        SamplingParams(max_tokens=1, temperature=temperature),
    ]
    out = sample_batch(logits, params, [None, None])
    assert not isinstance(out[0], Exception) and not isinstance(out[1], Exception)
    best_allowed = allowed[int(logits[0, allowed].argmax())]
    assert out[0].token_id == best_allowed
    assert out[1].token_id == int(logits[1].argmax())
