"""Completions sampled straight from a loaded model with transformers' `generate`, for the
bench scripts that read what a model writes with no server in between
(`bench/tool_forms.py`, `bench/complaint_prompts.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Completion:
    """One sampled completion, cut at the first stop token."""

    text: str
    tokens: int  # before the first stop token
    ended: bool  # a stop token came before the budget ran out


def sample_completions(
    lm: Any, ids: list[int], n: int, max_tokens: int, temperature: float | None
) -> list[Completion]:
    """`n` completions of the prompt `ids` from `lm` (a `liveloop.models.LoadedModel`) in one
    batched `generate` call: sampled at `temperature` (no top-p or top-k cut), or greedy when
    it is None. The caller seeds torch for reproducible draws."""
    import torch

    tok = lm.tokenizer
    eos = lm.model.generation_config.eos_token_id
    stops = {tok.eos_token_id, *(eos if isinstance(eos, list) else [eos])}
    sampling: dict[str, Any] = (
        {"do_sample": False}
        if temperature is None
        else {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
    )
    with torch.no_grad():
        out = lm.model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_tokens,
            num_return_sequences=n,
            pad_token_id=tok.pad_token_id,
            **sampling,
        )
    completions = []
    for seq in out:
        completion = seq[len(ids) :].tolist()
        ends = [i for i, t in enumerate(completion) if t in stops]
        completion = completion[: ends[0]] if ends else completion
        text = tok.decode(completion, skip_special_tokens=True)
        completions.append(Completion(text, len(completion), bool(ends)))
    return completions
