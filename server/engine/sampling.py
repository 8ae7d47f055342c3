"""Turning a batch of logits into sampled tokens with their raw-distribution log-probs.

Kept apart from the decode loop so the sampling rules (temperature, top-p, seeds, grammar
masks) can be read and tested on their own. The log-prob reported for a token is always
taken from the raw model distribution (log_softmax of the logits, before temperature,
top-p or masks), because that is the behaviour probability PPO needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from server.engine.types import EngineError, SamplingParams


@dataclass
class Sampled:
    """One row's sampled token with its raw log-prob and top alternatives."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]


def nucleus_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail of `probs` outside the smallest set whose mass reaches `top_p`."""
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs[mass_before >= top_p] = 0.0  # the top token always has mass_before 0
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def _sample_row(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    vocab_size: int,
) -> int:
    """Sample one token id from a row of logits under the request's rules."""
    constraint = params.constraint
    mask = constraint.allowed_token_mask(vocab_size) if constraint is not None else None
    if mask is not None:
        mask = mask.to(device=logits.device, dtype=torch.bool)
        if mask.shape != (vocab_size,):
            raise EngineError(
                f"constraint mask has shape {tuple(mask.shape)}, want ({vocab_size},)"
            )
        if not bool(mask.any()):
            raise EngineError("constraint allows no token")
        logits = logits.masked_fill(~mask, float("-inf"))
    if params.temperature == 0:
        return int(logits.argmax().item())
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        probs = nucleus_filter(probs, params.top_p)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def needs_row_sampling(params: SamplingParams) -> bool:
    """False when a request's token is simply the argmax of the raw logits."""
    return params.temperature != 0 or params.constraint is not None


def sample_batch(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[Sampled | Exception]:
    """Sample one token for each row of `logits` `[rows, vocab]`.

    A row whose request fails (a broken grammar hook) gets its exception instead.
    """
    vocab_size = logits.shape[-1]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    greedy = logits.argmax(dim=-1).tolist()
    k = max((p.top_logprobs for p in params), default=0)
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if k:
        vals, ids = logprobs.topk(k, dim=-1)
        top_vals, top_ids = vals.tolist(), ids.tolist()
    tokens: list[int | Exception] = []
    for i, p in enumerate(params):
        try:
            tokens.append(
                _sample_row(logits[i], p, generators[i], vocab_size)
                if needs_row_sampling(p)
                else greedy[i]
            )
        except Exception as exc:  # a failing grammar hook fails its own request only
            tokens.append(exc)
    index = torch.tensor([t if isinstance(t, int) else 0 for t in tokens], device=logits.device)
    chosen = logprobs.gather(1, index[:, None])[:, 0].tolist()
    out: list[Sampled | Exception] = []
    for i, (tok, p) in enumerate(zip(tokens, params, strict=True)):
        if isinstance(tok, Exception):
            out.append(tok)
            continue
        n = p.top_logprobs
        top = list(zip(top_ids[i][:n], top_vals[i][:n], strict=True)) if n else []
        out.append(Sampled(token_id=tok, logprob=chosen[i], top_logprobs=top))
    return out


def find_stop_string(tokenizer: Any, output_ids: list[int], stops: list[str]) -> str | None:
    """The stop string that the completion's text now contains (earliest match), if any.

    Only a tail of the completion is decoded: generation stops at the first match, so a new
    match must involve the newest token, and a string of n characters spans at most 4n
    byte-level tokens.
    """
    longest = max((len(s) for s in stops), default=0)
    if not longest:
        return None
    text = tokenizer.decode(output_ids[-(4 * longest + 4) :], skip_special_tokens=True)
    hits = [(text.find(s), s) for s in stops if s and s in text]
    return min(hits)[1] if hits else None
