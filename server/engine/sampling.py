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

from liveloop.server.engine.types import EngineError, SamplingParams


@dataclass
class Sampled:
    """One row's sampled token with its raw log-prob and top alternatives."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]


GREEDY_BELOW = 1e-5
"""Temperatures below this sample the argmax, as 0 does: divided by a float32 temperature
that small (1e-308 is a valid request, and is 0 in float32) the logits overflow, and their
softmax is NaN."""


def nucleus_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail of `probs` outside the smallest set whose mass reaches `top_p`."""
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs[mass_before >= top_p] = 0.0  # the top token always has mass_before 0
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def _constraint_masks(
    logits: torch.Tensor, params: list[SamplingParams], failed: dict[int, Exception]
) -> torch.Tensor:
    """`logits` with every constrained row's disallowed tokens at -inf (a copy if any).

    A row whose grammar hook fails or allows nothing gets its exception in `failed`.
    """
    vocab_size = logits.shape[-1]
    rows: list[int] = []
    masks: list[torch.Tensor] = []
    for i, p in enumerate(params):
        if p.constraint is None:
            continue
        try:
            mask = p.constraint.allowed_token_mask(vocab_size)
            if mask is None:
                continue
            mask = mask.to(device=logits.device, dtype=torch.bool)
            if mask.shape != (vocab_size,):
                raise EngineError(
                    f"constraint mask has shape {tuple(mask.shape)}, want ({vocab_size},)"
                )
            if not bool(mask.any()):
                raise EngineError("constraint allows no token")
        except Exception as exc:  # a failing grammar hook fails its own request only
            failed[i] = exc
            continue
        rows.append(i)
        masks.append(mask)
    if not rows:
        return logits
    shaped = logits.clone()
    index = torch.tensor(rows, device=logits.device)
    shaped[index] = shaped[index].masked_fill(~torch.stack(masks), float("-inf"))
    return shaped


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of `probs` `[rows, vocab]` (rows need not sum to 1; overwritten).

    Inverse-CDF sampling: one uniform number per row, from the row's own generator when it
    has one (so a seeded request samples the same tokens whatever else is in the batch),
    then one in-place batched cumsum and search. Far cheaper than `torch.multinomial` per
    row, which dominated the decode step of a small model with a large vocabulary.
    """
    device = probs.device
    parts = [
        torch.rand(1, generator=g, device=device) if g is not None else None for g in generators
    ]
    fill = iter(torch.rand(sum(p is None for p in parts), device=device).split(1))
    uniform = torch.cat([p if p is not None else next(fill) for p in parts])
    cdf = probs.cumsum_(-1)
    total = cdf[:, -1:]
    chosen: list[int] = torch.searchsorted(cdf, uniform[:, None] * total, right=True)[:, 0].tolist()
    vocab_size = probs.shape[-1]
    for row, token in enumerate(chosen):
        if token >= vocab_size:  # u * total rounded up to the total: the last possible token
            chosen[row] = int((cdf[row] < total[row]).sum())
    return chosen


def _probabilities(
    shaped: torch.Tensor,
    raw: tuple[torch.Tensor, torch.Tensor],
    temperatures: list[float],
    rows: list[int],
) -> torch.Tensor:
    """Softmax of the chosen rows at their temperatures (a fresh tensor).

    The common case (every row, temperature 1, no grammar mask) is `exp(logprobs)`, which
    saves a pass and an allocation over the whole batch.
    """
    logits, logprobs = raw
    whole = len(rows) == len(shaped)
    if whole and shaped is logits and all(t == 1.0 for t in temperatures):
        return logprobs.exp()
    picked = shaped if whole else shaped[rows]
    if any(t != 1.0 for t in temperatures):
        temps = torch.tensor(temperatures, device=shaped.device, dtype=shaped.dtype)
        picked = picked / temps[:, None]
    return torch.softmax(picked, dim=-1)


def choose_tokens(
    logits: torch.Tensor,
    logprobs: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    failed: dict[int, Exception],
) -> list[int]:
    """Each healthy row's token: argmax at temperature 0 (or below `GREEDY_BELOW`), else a
    temperature/top-p draw."""
    shaped = _constraint_masks(logits, params, failed)
    tokens = [0] * len(params)
    healthy = [i for i in range(len(params)) if i not in failed]
    greedy = [i for i in healthy if params[i].temperature < GREEDY_BELOW]
    sampled = [i for i in healthy if params[i].temperature >= GREEDY_BELOW]
    if greedy:
        rows = shaped if len(greedy) == len(params) else shaped[greedy]
        for i, token in zip(greedy, rows.argmax(dim=-1).tolist(), strict=True):
            tokens[i] = token
    if sampled:
        temperatures = [params[i].temperature for i in sampled]
        probs = _probabilities(shaped, (logits, logprobs), temperatures, sampled)
        for row, i in enumerate(sampled):
            if params[i].top_p < 1.0:
                probs[row] = nucleus_filter(probs[row], params[i].top_p)
        drawn = draw(probs, [generators[i] for i in sampled])
        for i, token in zip(sampled, drawn, strict=True):
            tokens[i] = token
    return tokens


def sample_batch(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[Sampled | Exception]:
    """Sample one token for each row of `logits` `[rows, vocab]`.

    A row whose request fails (a broken grammar hook) gets its exception instead.
    """
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    k = max((p.top_logprobs for p in params), default=0)
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if k:
        vals, ids = logprobs.topk(k, dim=-1)
        top_vals, top_ids = vals.tolist(), ids.tolist()
    failed: dict[int, Exception] = {}
    tokens = choose_tokens(logits, logprobs, params, generators, failed)
    index = torch.tensor(tokens, device=logits.device)
    chosen = logprobs.gather(1, index[:, None])[:, 0].tolist()
    out: list[Sampled | Exception] = []
    for i, (tok, p) in enumerate(zip(tokens, params, strict=True)):
        if i in failed:
            out.append(failed[i])
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
