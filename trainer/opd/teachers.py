"""Teachers: who scores the sampled tokens under the hinted prompt.

A teacher gets (enhanced prompt ids, completion ids) pairs and returns the log-prob of every
completion token after its enhanced prompt. Four kinds:

- `policy`: the weights being trained, as they are before the update (self-distillation:
  the policy, told the hint, teaches itself without it);
- `reference`: the frozen initial weights (LoRA: the base model with the adapter off);
- `model`: another local model (a bigger one of the same family, say), loaded frozen in the
  trainer once; its tokenizer must be the policy's, which is checked when it is loaded;
- `endpoint`: another model behind an HTTP server that returns prompt log-probs
  (`liveloop.trainer.opd.endpoint`).

Every teacher works to a deadline: pairs it has not scored by then are reported as
'time_budget' and trained without OPD.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from liveloop.config import ConfigError
from liveloop.contracts import BatchSample
from liveloop.trainer.data import MicroBatch, build_micro_batch, pack_bins
from liveloop.trainer.policy import Policy, completion_logprobs

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TeacherItem:
    """One hinted turn to score: its key, enhanced prompt ids and completion ids."""

    key: str
    prompt_ids: list[int]
    completion_ids: list[int]


@dataclass
class TeacherScores:
    """What a teacher returned: log-probs by sample key, and why the others have none."""

    logprobs: dict[str, list[float]] = field(default_factory=dict)
    failed: Counter[str] = field(default_factory=Counter)


class Teacher(Protocol):
    """Scores completion tokens after enhanced prompts, before `deadline` (perf_counter)."""

    name: str

    def score(self, items: list[TeacherItem], deadline: float) -> TeacherScores:
        """Log-probs of each item's completion tokens; unscored items are counted."""
        ...

    def close(self) -> None:
        """Release what the teacher holds (HTTP clients, threads)."""
        ...


def as_sample(item: TeacherItem) -> BatchSample:
    """A batch sample shaped like the item, so the trainer's packing can be reused."""
    n = len(item.completion_ids)
    return BatchSample.model_construct(
        key=item.key,
        prompt_token_ids=item.prompt_ids,
        completion_token_ids=item.completion_ids,
        logprobs=[0.0] * n,
        versions=[0] * n,
        advantage=0.0,
        score=0.0,
        hint=None,
    )


class LocalTeacher:
    """A teacher in this process: a forward pass of some weights, no gradient.

    Items are packed into micro-batches of `micro_batch_tokens` like training sequences;
    the deadline is checked before each micro-batch.
    """

    def __init__(
        self,
        name: str,
        logprobs: Callable[[MicroBatch], torch.Tensor],
        micro_batch_tokens: int,
        device: str,
    ) -> None:
        self.name = name
        self._logprobs = logprobs
        self.micro_batch_tokens = micro_batch_tokens
        self.device = device

    def score(self, items: list[TeacherItem], deadline: float) -> TeacherScores:
        """Teacher log-probs per item, packed micro-batch by micro-batch until the deadline."""
        import torch

        out = TeacherScores()
        bins = pack_bins([as_sample(i) for i in items], self.micro_batch_tokens)
        for index, group in enumerate(bins):
            if time.perf_counter() > deadline:
                out.failed["time_budget"] += sum(len(g) for g in bins[index:])
                break
            mb = build_micro_batch(group, self.device)
            with torch.no_grad():
                values = self._logprobs(mb).float().cpu().tolist()
            offset = 0
            for sample in group:
                n = len(sample.completion_token_ids)
                out.logprobs[sample.key] = values[offset : offset + n]
                offset += n
        return out

    def close(self) -> None:
        """Nothing to release."""


def policy_teacher(policy: Policy, micro_batch_tokens: int, device: str) -> LocalTeacher:
    """Self-distillation: the policy's own weights, as they are when the batch starts."""

    def logprobs(mb: MicroBatch) -> torch.Tensor:
        return completion_logprobs(policy.model, mb)[0]

    return LocalTeacher("policy", logprobs, micro_batch_tokens, device)


def reference_teacher(policy: Policy, micro_batch_tokens: int, device: str) -> LocalTeacher:
    """The frozen initial weights (needs the policy's reference copy, or LoRA)."""
    if not policy.has_reference:
        raise RuntimeError("the reference teacher needs the reference model to be loaded")
    return LocalTeacher("reference", policy.reference_logprobs, micro_batch_tokens, device)


def tokenizer_mismatch(student: Any, teacher: Any) -> str | None:
    """Why two tokenizers would not give the same ids for the same text, or None."""
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    if len(mine) != len(theirs):
        return f"vocabularies of {len(mine)} and {len(theirs)} tokens"
    differ = sum(1 for token, index in mine.items() if theirs.get(token) != index)
    if differ:
        return f"{differ} of {len(mine)} tokens have other ids"
    if student.eos_token != teacher.eos_token:
        return f"end-of-text tokens {student.eos_token!r} and {teacher.eos_token!r}"
    return None


def model_teacher(
    spec: str, policy: Policy, micro_batch_tokens: int, device: str, cache: dict[str, Any]
) -> LocalTeacher:
    """Another local model, frozen; loaded once per trainer (kept in `cache` across reloads
    of the policy). ConfigError when its tokenizer is not the policy's."""
    from liveloop.models import load_model

    key = f"teacher:{spec}:{device}"
    if key not in cache:
        loaded = load_model(spec, device=device)
        problem = tokenizer_mismatch(policy.tokenizer, loaded.tokenizer)
        if problem is not None:
            raise ConfigError(
                f"trainer.opd.teacher_model = {spec!r}: its tokenizer is not the policy's "
                f"({problem}); a teacher must score the very token ids the policy sampled"
            )
        loaded.model.requires_grad_(False)
        cache[key] = loaded.model
    teacher = cache[key]

    def logprobs(mb: MicroBatch) -> torch.Tensor:
        return completion_logprobs(teacher, mb)[0]

    return LocalTeacher(f"model:{spec}", logprobs, micro_batch_tokens, device)
