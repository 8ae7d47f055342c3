"""The teacher signal of one batch: enhanced prompts for its hinted turns, scored by the teacher.

`Distiller.signal(samples)` runs once per update, before the first optimizer step (so the
`policy` teacher is the weights the batch starts from, the same ones that give the proximal
log-probs). It builds each hinted sample's enhanced prompt, leaves out those it cannot build
exactly or that are longer than `max_turn_tokens`, and asks the teacher for the rest within
`batch_time_budget_s`. Everything left out is counted by reason and trained without OPD.

With `advantage = "contrastive"` the teacher also scores each taught reply after the turn's
own prompt, and the signal is the difference, log pi_T(a | s + hint) - log pi_T(a | s): what
the hint changes in the teacher, without what the teacher and the student disagree on anyway.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from liveloop.config.opd import OPDSettings
from liveloop.contracts import BatchSample
from liveloop.trainer.opd.prompts import HintInserter
from liveloop.trainer.opd.teachers import (
    Teacher,
    TeacherItem,
    model_teacher,
    policy_teacher,
    reference_teacher,
)
from liveloop.trainer.policy import Policy

# Key suffix of a contrastive pair's second item: the reply after the turn's own prompt.
PLAIN = "|plain"
# Why a hinted turn got no teacher signal (the order of the reduced statistics).
SKIP_REASONS = ("template", "mismatch", "too_long", "time_budget", "teacher_error")


@dataclass
class TeacherSignal:
    """Teacher log-probs of a batch's hinted samples, by key, and what was left out."""

    logprobs: dict[str, list[float]] = field(default_factory=dict)
    hinted: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0


def make_teacher(
    cfg: OPDSettings,
    policy: Policy,
    micro_batch_tokens: int,
    device: str,
    model_name: str,
    cache: dict[str, Any] | None = None,
) -> Teacher:
    """The configured teacher (`cache` keeps a loaded teacher model across calls)."""
    if cfg.teacher == "reference":
        return reference_teacher(policy, micro_batch_tokens, device)
    if cfg.teacher == "model":
        assert cfg.teacher_model is not None  # checked by the settings
        return model_teacher(
            cfg.teacher_model, policy, micro_batch_tokens, device, {} if cache is None else cache
        )
    if cfg.teacher == "endpoint":
        from liveloop.trainer.opd.endpoint import EndpointTeacher

        return EndpointTeacher(cfg.endpoint, model_name)
    return policy_teacher(policy, micro_batch_tokens, device)


def _contrasts(scored: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per taught reply, hinted minus plain teacher log-probs (pairs with both scored)."""
    out = {}
    for key, hinted in scored.items():
        plain = scored.get(key + PLAIN)
        if not key.endswith(PLAIN) and plain is not None:
            out[key] = [h - p for h, p in zip(hinted, plain, strict=True)]
    return out


class Distiller:
    """Turns the hinted samples of a batch into teacher log-probs, within the budgets."""

    def __init__(
        self, cfg: OPDSettings, policy: Policy, teacher: Teacher, tool_result_reminder: str = ""
    ) -> None:
        self.cfg = cfg
        self.inserter = HintInserter(
            policy.tokenizer, cfg.hint_role, cfg.hint_template, tool_result_reminder
        )
        self.teacher = teacher

    def items(self, samples: list[BatchSample], signal: TeacherSignal) -> list[TeacherItem]:
        """Enhanced prompts of the hinted samples that can have one (others counted)."""
        items = []
        for sample in samples:
            if sample.hint is None:
                continue
            signal.hinted += 1
            hint = sample.hint
            enhanced = self.inserter.insert(
                sample.prompt_token_ids, hint.messages, hint.tools, hint.text
            )
            if enhanced.ids is None:
                signal.skipped[enhanced.failure or "template"] += 1
                continue
            if len(enhanced.ids) + len(sample.completion_token_ids) > self.cfg.max_turn_tokens:
                signal.skipped["too_long"] += 1
                continue
            items.append(TeacherItem(sample.key, enhanced.ids, sample.completion_token_ids))
            if self.cfg.advantage == "contrastive":
                plain = TeacherItem(sample.key + PLAIN, sample.prompt_token_ids,
                                    sample.completion_token_ids)  # fmt: skip
                items.append(plain)
        return items

    def signal(self, samples: list[BatchSample]) -> TeacherSignal:
        """Teacher log-probs for every hinted sample that fits the budgets."""
        start = time.perf_counter()
        signal = TeacherSignal()
        items = self.items(samples, signal)
        if items:
            scores = self.teacher.score(items, start + self.cfg.batch_time_budget_s)
            if self.cfg.advantage == "contrastive":  # a reply with half its pair scored is out
                signal.logprobs = _contrasts(scores.logprobs)
                missing = len(items) // 2 - len(signal.logprobs)
                common = scores.failed.most_common(1)
                if missing:
                    signal.skipped[common[0][0] if common else "teacher_error"] += missing
            else:
                signal.logprobs = scores.logprobs
                signal.skipped.update(scores.failed)
        signal.seconds = time.perf_counter() - start
        return signal

    def close(self) -> None:
        """Release the teacher."""
        self.teacher.close()
