"""Sampling the gate's probe replies in one batch, with each prompt's tokens run once.

The gate answers a few dozen probes per version. Their prompts differ in length (a first
question, a question after two exchanges) and most share a long start (the system message,
the tools' schemas). A batched `generate` pads every prompt on the left to the longest and
runs the padding and the shared start once per row, which on a small CPU is a large part of
a probe's time. Here the shared start is run once and its keys and values are given
to every row, the rest of each prompt is run in groups of similar length, and the rows'
keys and values are then laid side by side (a gap of masked positions between the shared
start and each row's own tokens) for one batched decode: the same replies and log-probs as
a padded batch (to float rounding), for the prompt tokens alone.

Each row draws with its own seeded random numbers (`RowSampler`), so a prompt's reply does
not depend on what else is in the batch. A model whose cache is not a plain list of keys and
values per layer (sliding windows, say) is sampled with a left-padded `generate`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from liveloop.trainer.safeguards.prefixes import cache_argument
from liveloop.trainer.safeguards.probing import Sampled

if TYPE_CHECKING:
    import torch

# Prompts grouped for their prefill are at most this much longer than the group's shortest.
LENGTH_SLACK = 1.15


class RowSampler:
    """A logits processor that turns greedy decoding into sampling at `temperature`, each row
    with its own seeded generator (the Gumbel-max trick: the largest of logit / temperature
    plus Gumbel noise is a draw from the tempered softmax). A row's draws depend only on its
    seed, never on the batch around it, unlike `generate`'s own sampling."""

    def __init__(self, seeds: Sequence[int], temperature: float) -> None:
        import torch

        self.generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        self.temperature = temperature

    def __call__(self, input_ids: torch.Tensor | None, scores: torch.Tensor) -> torch.Tensor:
        import torch

        vocab = scores.shape[-1]
        uniform = torch.stack([torch.rand(vocab, generator=g) for g in self.generators])
        gumbel = -torch.log(-torch.log(uniform.clamp(1e-20, 1.0 - 1e-7)))
        return scores.float() / self.temperature + gumbel.to(scores.device)


@dataclass
class Prefilled:
    """Every prompt but its last token, run: the keys and values laid out for one batch."""

    cache: Any  # the transformers cache: per layer, keys and values [rows, heads, width, dim]
    mask: torch.Tensor  # [rows, width]: 1 where a row has a token
    lengths: list[int]  # each prompt's length (its last token is the first one decoded)


def sample_replies(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    *,
    max_tokens: int,
    temperature: float,
    seeds: Sequence[int],
) -> Sampled:
    """Sample one reply per prompt, all in one batch, each prompt's with the random numbers of
    its own seed: the same prompt and seed give the same reply whatever else is in the
    batch. Each reply token's log-prob is the untempered one of the model that sampled it."""
    import torch

    eos_ids = end_ids(model, tokenizer)
    sampler = RowSampler(seeds, temperature)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            prefilled = prefill(model, prompts)
            if prefilled is None:
                tokens, logprobs = generate_padded(
                    model, tokenizer, prompts, sampler, max_tokens, eos_ids
                )
            else:
                tokens, logprobs = decode(model, prompts, prefilled, sampler, max_tokens, eos_ids)
    finally:
        model.train(was_training)
    completions: list[list[int]] = []
    for row in tokens.tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        completions.append(row[:cut])
    texts = [tokenizer.decode(c, skip_special_tokens=True).strip() for c in completions]
    own = [logprobs[i, : len(c)] for i, c in enumerate(completions)]
    return Sampled(list(prompts), completions, texts, own)


def end_ids(model: Any, tokenizer: Any) -> list[int]:
    """The token ids that end a reply: the model's generation config's, else the tokenizer's."""
    eos = model.generation_config.eos_token_id or tokenizer.eos_token_id
    return sorted(set(eos if isinstance(eos, list) else [eos]))


def shared_start(prompts: Sequence[Sequence[int]]) -> int:
    """How many first tokens every prompt has in common, short of each one's last token."""
    limit = min(len(p) for p in prompts) - 1
    first = prompts[0]
    for n in range(max(limit, 0)):
        if any(p[n] != first[n] for p in prompts):
            return n
    return max(limit, 0)


def length_groups(lengths: Sequence[int], slack: float = LENGTH_SLACK) -> list[list[int]]:
    """Row indices grouped by length, shortest first: a group's longest is at most `slack`
    times its shortest (plus one), so that padding inside a group stays small."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[i] <= slack * lengths[groups[-1][0]] + 1:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def prefill(model: Any, prompts: Sequence[Sequence[int]]) -> Prefilled | None:
    """Run every prompt but its last token: the shared start once, the rest in length groups,
    into one cache laid out [shared start | masked gap | the row's own tokens]. None when the
    model's cache is not plain keys and values per layer."""
    import torch

    device = next(model.parameters()).device
    start = shared_start(prompts)
    own = [len(p) - 1 - start for p in prompts]  # tokens each row runs beyond the shared start
    width = max(own)
    keyword = cache_argument(model)
    head = None
    if start:
        out = model(input_ids=torch.tensor([list(prompts[0][:start])], device=device),
                    use_cache=True, logits_to_keep=1)  # fmt: skip
        head = getattr(out, keyword)
        if not _plain(head):
            return None
    layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    for group in length_groups(own):
        group_width = max(own[i] for i in group)
        if group_width == 0:
            continue
        ids, mask, positions = _group_inputs(prompts, group, start, group_width, device)
        cache = _repeated(head, len(group)) if head is not None else None
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    logits_to_keep=1, **({keyword: cache} if cache is not None else {}))  # fmt: skip
        grown = getattr(out, keyword)
        if not _plain(grown):
            return None
        layers = layers or _empty_layers(grown, len(prompts), width)
        for (keys, values), layer in zip(layers, grown.layers, strict=True):
            for row, i in enumerate(group):  # each row's own tokens, right-aligned
                taken = slice(start + group_width - own[i], None)
                keys[i, :, width - own[i] :] = layer.keys[row, :, taken]
                values[i, :, width - own[i] :] = layer.values[row, :, taken]
    return _joined(head, layers, own, start, width, len(prompts), device)


def _group_inputs(
    prompts: Sequence[Sequence[int]], group: list[int], start: int, width: int, device: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A length group's own tokens, left-padded to `width`, with the mask over the shared
    start and them, and their positions (after the shared start)."""
    import torch

    rows, masks, positions = [], [], []
    for i in group:
        mine = list(prompts[i][start:-1])
        gap = width - len(mine)
        rows.append([mine[0] if mine else 0] * gap + mine)
        masks.append([1] * start + [0] * gap + [1] * len(mine))
        positions.append([start] * gap + list(range(start, start + len(mine))))
    return (torch.tensor(rows, device=device), torch.tensor(masks, device=device),
            torch.tensor(positions, device=device))  # fmt: skip


def _plain(cache: Any) -> bool:
    """Whether `cache` keeps every layer's keys and values whole (transformers' DynamicLayer)."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # a transformers without cache layers: `generate` does it all
        return False
    layers: list[Any] = list(getattr(cache, "layers", None) or [])
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def _repeated(head: Any, rows: int) -> Any:
    """A new cache holding the shared start's keys and values once per row."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for index, layer in enumerate(head.layers):
        cache.update(
            layer.keys.expand(rows, -1, -1, -1), layer.values.expand(rows, -1, -1, -1), index
        )
    return cache


def _empty_layers(cache: Any, rows: int, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed keys and values for every row's own tokens, shaped like `cache`'s layers."""
    import torch

    out = []
    for layer in cache.layers:
        heads, dim = layer.keys.shape[1], layer.keys.shape[3]
        shape = (rows, heads, width, dim)
        out.append(
            (torch.zeros(shape, dtype=layer.keys.dtype, device=layer.keys.device),
             torch.zeros(shape, dtype=layer.values.dtype, device=layer.values.device))
        )  # fmt: skip
    return out


def _joined(
    head: Any,
    layers: list[tuple[torch.Tensor, torch.Tensor]] | None,
    own: list[int],
    start: int,
    width: int,
    rows: int,
    device: Any,
) -> Prefilled:
    """The shared start's keys and values beside each row's own, in one cache."""
    import torch
    from transformers import DynamicCache

    mask = torch.tensor(
        [[1] * start + [0] * (width - n) + [1] * n for n in own], dtype=torch.long, device=device
    )
    lengths = [start + n + 1 for n in own]
    if head is None and layers is None:  # one-token prompts: nothing to run before decoding
        return Prefilled(None, mask, lengths)
    cache = _repeated(head, rows) if head is not None else DynamicCache()
    for index, (keys, values) in enumerate(layers or []):
        cache.update(keys, values, index)  # after the shared start's, where there is one
    return Prefilled(cache, mask, lengths)


def decode(
    model: Any,
    prompts: Sequence[Sequence[int]],
    prefilled: Prefilled,
    sampler: RowSampler,
    max_tokens: int,
    eos_ids: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `max_tokens` tokens per row from each prompt's last token on, over the prefilled
    keys and values, and each drawn token's untempered log-prob; a finished row gets the
    first end-of-sequence id until every row is finished."""
    import torch

    device = prefilled.mask.device
    last = torch.tensor([[p[-1]] for p in prompts], device=device)
    positions = torch.tensor([[n - 1] for n in prefilled.lengths], device=device)
    mask, cache, keyword = prefilled.mask, prefilled.cache, cache_argument(model)
    eos = torch.tensor(eos_ids, device=device)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    tokens, logprobs = [], []
    for _ in range(max_tokens):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        out = model(input_ids=last, attention_mask=mask, position_ids=positions, use_cache=True,
                    logits_to_keep=1, **({keyword: cache} if cache is not None else {}))  # fmt: skip
        cache = getattr(out, keyword)
        logits = out.logits[:, -1].float()
        drawn = torch.where(done, eos[0], sampler(last, logits).argmax(-1))
        logprobs.append(torch.log_softmax(logits, dim=-1).gather(1, drawn[:, None]).squeeze(1))
        tokens.append(drawn)
        done |= torch.isin(drawn, eos)
        if bool(done.all()):
            break
        last, positions = drawn[:, None], positions + 1
    return torch.stack(tokens, dim=1).cpu(), torch.stack(logprobs, dim=1).cpu()


def generate_padded(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    sampler: RowSampler,
    max_tokens: int,
    eos_ids: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same draws through `generate`, left-padded (for caches `prefill` cannot lay out)."""
    import torch
    from transformers import LogitsProcessorList

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        input_ids=ids.to(model.device),
        attention_mask=mask.to(model.device),
        do_sample=False,  # the sampling is RowSampler's: the largest noised logit
        temperature=None,
        top_k=None,
        top_p=None,
        logits_processor=LogitsProcessorList([sampler]),
        max_new_tokens=max_tokens,
        pad_token_id=pad,
        eos_token_id=eos_ids,
        return_dict_in_generate=True,
        output_logits=True,
    )
    sampled = out.sequences[:, width:]
    steps = [
        torch.log_softmax(step.float(), dim=-1).gather(1, sampled[:, i, None]).squeeze(1)
        for i, step in enumerate(out.logits)
    ]
    return sampled.cpu(), torch.stack(steps, dim=1).cpu()
