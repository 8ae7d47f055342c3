"""The reference model's keys and values of each probe prompt, computed once per probe set.

The gate measures every version it probes under the reference model: each reply token's
log-prob there gives the reply's NLL and the KL to the reference. The reference's weights
never change (the frozen copy loaded at start-up, or the base under LoRA adapters), and a
probe set stands for `refresh_versions` candidates, so the reference's pass over a probe's
prompt is the same for every candidate. A probe's prompt is often many times longer than
its reply (a served request with its system message and history), and one forward over a
set's prompts and replies packed in a row costs time quadratic in the whole row. Here each
prompt is run once, its keys and values are kept, and each candidate's reply is then run
over them alone: the same log-probs (to float rounding), for a fraction of the time.

Entries are kept up to a memory budget (`GateSettings.reference_cache_mib`, on the model's
device); a prompt beyond it is run with its reply each time, one probe at a time. The gate
drops the entries of probes it no longer holds at each draw, and a tenant's gate (and its
entries) goes with the tenant.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from liveloop.trainer.policy import Policy


@contextlib.contextmanager
def reference_weights(policy: Policy) -> Iterator[Any]:
    """The reference model to generate with: the frozen copy, or the base under LoRA."""
    if policy.lora:
        with policy.model.disable_adapter():
            yield policy.model
    else:
        if policy.reference is None:
            raise RuntimeError("the promotion gate needs the reference model")
        yield policy.reference


@dataclass
class PromptEntry:
    """One prompt's keys and values under the reference, and its next-token log-probs."""

    cache: Any  # the transformers Cache the prompt's forward returned
    first: torch.Tensor  # log-softmax at the prompt's last position: the reply's first token
    length: int  # prompt tokens: what the cache holds between replies
    nbytes: int


class ReferencePrompts:
    """Reference log-probs of replies, over kept prompt keys and values."""

    def __init__(self, budget_mib: int) -> None:
        self.budget = budget_mib * 2**20
        self.entries: dict[tuple[int, ...], PromptEntry] = {}
        self.encoded = 0  # prompts run through the reference (kept or not)
        self.reused = 0  # replies scored over a kept prompt

    @property
    def used(self) -> int:
        """Bytes the kept entries hold."""
        return sum(entry.nbytes for entry in self.entries.values())

    def logprobs(
        self, model: Any, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> list[torch.Tensor]:
        """Each completion token's log-prob under `model` (the reference; on the CPU), with
        the prompt before it: one tensor per (prompt, completion) pair."""
        import torch

        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                return [
                    self._scored(model, prompt, completion)
                    for prompt, completion in zip(prompts, completions, strict=True)
                ]
        finally:
            model.train(was_training)

    def keep_only(self, prompts: Iterable[Sequence[int]]) -> None:
        """Drop the entries of every prompt not in `prompts` (the sets drawn now)."""
        wanted = {tuple(prompt) for prompt in prompts}
        self.entries = {key: e for key, e in self.entries.items() if key in wanted}

    def clear(self) -> None:
        """Drop every entry (the gate's tenant left the trainer's memory)."""
        self.entries.clear()

    def _scored(self, model: Any, prompt: Sequence[int], completion: Sequence[int]) -> Any:
        import torch

        if not completion:
            return torch.zeros(0)
        key = tuple(prompt)
        entry = self.entries.get(key)
        if entry is not None:
            self.reused += 1
            return self._over(model, entry, completion, keep=True)
        entry = self._encode(model, prompt)
        keep = self.used + entry.nbytes <= self.budget
        if keep:
            self.entries[key] = entry
        return self._over(model, entry, completion, keep=keep)

    def _encode(self, model: Any, prompt: Sequence[int]) -> PromptEntry:
        """Run the prompt once, keeping its keys and values and its last position's log-probs."""
        import torch

        self.encoded += 1
        ids = torch.tensor([list(prompt)], device=_device(model))
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        first = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        cache = getattr(out, cache_argument(model))
        return PromptEntry(cache, first, len(prompt), _cache_bytes(cache))

    def _over(self, model: Any, entry: PromptEntry, completion: Sequence[int], keep: bool) -> Any:
        """The completion's log-probs after the entry's prompt; a kept entry's cache is cut
        back to the prompt afterwards (or dropped if it cannot be)."""
        import torch

        head = entry.first[completion[0]].reshape(1)
        if len(completion) == 1:
            return head.cpu()
        ids = torch.tensor([list(completion[:-1])], device=entry.first.device)
        try:
            out = model(input_ids=ids, use_cache=True, **{cache_argument(model): entry.cache})
        finally:
            if keep:
                self._cut_back(entry)
        targets = torch.tensor(list(completion[1:]), device=entry.first.device)
        rest = torch.log_softmax(out.logits[0].float(), dim=-1)
        rest = rest.gather(1, targets[:, None]).squeeze(1)
        return torch.cat([head, rest]).cpu()

    def _cut_back(self, entry: PromptEntry) -> None:
        """Remove what a reply added to a kept entry's cache (a negative length to `crop`
        removes that many tokens in every transformers version the project supports)."""
        try:
            grown = entry.cache.get_seq_length() - entry.length
            if grown > 0:
                entry.cache.crop(-grown)
            restored = entry.cache.get_seq_length() == entry.length
        except (NotImplementedError, ValueError, AttributeError):  # a cache that cannot crop
            restored = False
        if not restored:  # run with its reply each time, as beyond the budget
            self.entries = {k: e for k, e in self.entries.items() if e is not entry}


def _device(model: Any) -> Any:
    return next(model.parameters()).device


def cache_argument(model: Any) -> str:
    """What the causal LM's forward (under a PEFT wrapper, its base's) calls the cache, in
    its argument and its output: transformers 5's `cache`, 4.x's `past_key_values`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _cache_bytes(cache: Any) -> int:
    """Bytes of a cache's key and value tensors."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        tensors = [t for layer in layers for t in (layer.keys, layer.values) if t is not None]
    else:  # older caches keep two lists
        tensors = [*cache.key_cache, *cache.value_cache]
    return sum(t.numel() * t.element_size() for t in tensors)
