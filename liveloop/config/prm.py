"""Settings of the judging loop (`liveloop judge`)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from liveloop.config.base import Section
from liveloop.config.consumer import ConsumerSettings, consumer_defaults
from liveloop.config.defaults import ANSWER_FROM_RESULT

DEFAULT_CORRECTIONS = [
    r"\bno\b[,.!]*\s+(?:that'?s|this is|it'?s)\s+(?:wrong|incorrect|not right)",
    r"\bthat'?s\s+(?:wrong|incorrect|not (?:right|correct|what i (?:asked|wanted|meant)))",
    r"\b(?:you'?re|you are|it'?s|it is|this is|that is)\s+(?:still\s+)?(?:wrong|incorrect)\b",
    r"\btry again\b",
    r"\btoo (?:long|short|verbose|wordy)\b",
    r"\bnot what i (?:asked|wanted|meant)\b",
    r"\bnot what the [\w ]{0,30}said\b",
    r"\b(?:doesn'?t|does not|didn'?t|did not) work\b",
    r"\bplease (?:fix|redo)\b",
    r"\bexplain (?:\w+ ){0,3}?(?:more|further|properly)\b",
    r"\bjust tell me\b",
    # the reply was no answer at all
    r"\bmakes? no sense\b",
    r"\b(?:doesn'?t|does not|don'?t|do not) make (?:any )?sense\b",
    r"\b(?:gibberish|nonsense|junk)\b",
    r"\bcan'?t understand\b",
    r"\b(?:you )?(?:didn'?t|did not|don'?t|do not) answer\b",
    r"\bnot an answer\b",
    r"\bnot (?:much of|really) an answer\b",
    r"\b(?:doesn'?t|does not|didn'?t|did not) (?:tell|say) (?:me )?anything\b",
    r"\bsays? nothing\b",
    r"\bstay on (?:the )?topic\b",
    r"\boff[- ]topic\b",
    r"\brepeating yourself\b",
    r"\bover and over\b",
    r"\bin plain (?:words|english)\b",
    # how it should have been instead
    r"\bshorter,? please\b",
    r"\b(?:in )?fewer words\b",
    r"\bkeep it (?:short|brief|under|to)\b",
    r"\bmore than i (?:need|wanted|asked)\b",
    r"\b(?:please )?(?:start|begin) (?:by|with|your answer)\b",
    r"\b(?:just )?(?:one|a single) sentence\b",
    r"\b(?:use|check with) the [\w ]{0,30}tool\b",
]
# Sentences of a user's reply that say how the reply should have been instead: they become
# the turn's directive hint ("Shorter, please: 20 words at most.").
DEFAULT_DIRECTIVES = [
    r"\btoo (?:long|short|verbose|wordy)\b",
    r"\b(?:shorter|briefer|longer)\b",
    r"\bbe (?:brief|concise)\b",
    r"\b(?:in )?fewer words\b",
    r"\b(?:at most|under|no more than) \w+ words\b",
    r"\b\w+ words at most\b",
    r"\bkeep it (?:short|brief|under|to)\b",
    r"\bmore than i (?:need|wanted|asked)\b",
    r"\b(?:start|begin) (?:by|with|your answer)\b",
    r"\b(?:one|a single) sentence\b",
    r"\b(?:at least|in) (?:a few|\w+) sentences\b",
    r"\bjust tell me\b",
    r"\b(?:use|check with) the [\w ]{0,30}tool\b",
    r"\bread the tool result\b",
    r"\bnot what the [\w ]{0,30}said\b",
    r"\bin plain (?:words|english)\b",
    r"\bno markup\b",
    r"\bstay on (?:the )?topic\b",
    r"\bi asked about\b",
    r"\b(?:tell me|say) (?:something|more) about\b",
]
DEFAULT_APPROVALS = [
    r"\bthanks?\b",
    r"\bthank you\b",
    r"\bperfect\b",
    r"\bexactly\b",
    r"\b(?:great|awesome|excellent|nice)\b",
    r"\bthat'?s (?:right|correct)\b",
    r"\b(?:works|worked) (?:now|great|perfectly)\b",
]
DEFAULT_TOOL_ERRORS = [
    r"traceback \(most recent call last\)",
    r"\bexit(?:ed)?(?: with)?[ _](?:code|status)\W{0,3}-?[1-9]\d*",
    r"error:",
    r'"error"\s*:\s*["{]',
    r"\bcommand not found\b",
    r"\bno such file or directory\b",
]

# (shortest non-trivial, longest kept) directive hint, in characters, unless configured
HINT_CHARS = (10, 300)


BUILTIN_SECTIONS = ("rules", "llm")  # judges whose settings have a section of their own


def _check_patterns(patterns: list[str]) -> list[str]:
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"invalid regular expression {pattern!r}: {exc}") from None
    return patterns


class RulesJudgeConfig(Section):
    """Patterns and scores of the built-in `rules` judge (matching is case-insensitive)."""

    correction_patterns: list[str] = Field(
        default_factory=lambda: list(DEFAULT_CORRECTIONS),
        description="Regexes that mark a user reply as a correction ('no, that's wrong').",
    )
    approval_patterns: list[str] = Field(
        default_factory=lambda: list(DEFAULT_APPROVALS),
        description="Regexes that mark a user reply as thanks/approval ('thanks', 'perfect').",
    )
    tool_error_patterns: list[str] = Field(
        default_factory=lambda: list(DEFAULT_TOOL_ERRORS),
        description="Regexes that mark a tool result as an error (tracebacks, exit codes).",
    )
    directive_patterns: list[str] = Field(
        default_factory=lambda: list(DEFAULT_DIRECTIVES),
        description="Regexes that mark a sentence of a user reply as saying how the reply "
        "should have been ('keep it under 20 words'); such sentences are the turn's directive "
        "hint. Empty = the rules judge gives no hints.",
    )
    correction_score: float = Field(
        -1.0, ge=-1, le=1, description="Score of a user reply that matches a correction."
    )
    approval_score: float = Field(
        1.0, ge=-1, le=1, description="Score of a user reply that matches only approval."
    )
    tool_error_score: float = Field(
        -1.0, ge=-1, le=1, description="Score of a tool result that matches a tool error."
    )
    tool_ok_score: float = Field(
        0.25, ge=-1, le=1, description="Score of a tool result without an error."
    )
    repeated_call_score: float | None = Field(
        -0.5,
        ge=-1,
        le=1,
        description="Score of a reply that calls a tool again with the same arguments after "
        "the conversation already holds that call's result (the tool has answered; calling it "
        "again is no progress and, scored like any tool result, would be rewarded); unset = "
        "such a turn is scored by what followed it, like any other.",
    )
    repeated_call_hint: str | None = Field(
        ANSWER_FROM_RESULT,
        description="Directive hint of a repeated call (`{name}`: the tool's name): the "
        "instruction a hindsight-distillation teacher sees beside the turn (`opd`, `combine`); "
        "unset = such a turn has none.",
    )
    neutral_score: float = Field(
        0.0, ge=-1, le=1, description="Score of a user reply that matches no pattern."
    )
    timeout_score: float | None = Field(
        None,
        ge=-1,
        le=1,
        description="Score of a turn with no next state before the timeout; unset = no opinion (silence is not evidence, so by default such turns pass on unscored and are counted).",
    )

    _check = field_validator(
        "correction_patterns", "approval_patterns", "tool_error_patterns", "directive_patterns"
    )(_check_patterns)


class LLMJudgeConfig(Section):
    """LLM-as-judge over any OpenAI-compatible endpoint."""

    base_url: str | None = Field(
        None, description="OpenAI-compatible base URL (default: this LiveLoop server's /v1)."
    )
    model: str | None = Field(None, description="Model name to ask (default: the served model).")
    api_key: str = Field("none", description="API key for the judge endpoint.")
    votes: int = Field(3, ge=1, le=15, description="Votes per turn; majority wins, ties give 0.")
    timeout_s: float = Field(30.0, gt=0, description="Timeout of one judge request.")
    concurrency: int = Field(8, ge=1, description="Most judge requests in flight.")
    max_tokens: int = Field(
        96, ge=1, description="Completion budget of one vote (a verdict and a short hint)."
    )
    temperature: float = Field(
        0.7, ge=0, le=2, description="Sampling temperature of a vote (votes should differ)."
    )
    max_chars: int = Field(
        4000, ge=200, description="Each prompt section (request, reply, next state) is cut to this."
    )
    hints: bool = Field(
        True,
        description="Ask each vote for a directive hint too (what the reply should have done "
        "differently, when the next state shows it); the longest among the votes is kept.",
    )
    output: Literal["text", "json"] = Field(
        "text",
        description="'text': a verdict word, then the hint between [HINT] and [/HINT]. "
        "'json': structured output (response_format json_schema) with 'verdict' and 'hint', "
        "which keeps a small judge model's votes parseable.",
    )
    json_schema: dict[str, Any] | None = Field(
        None,
        description="With output = 'json': the JSON schema of one vote (an object with "
        "'verdict' and optionally 'hint'); unset = the built-in schema.",
    )
    system_prompt: str | None = Field(
        None,
        description="The judge's instructions; unset = the built-in prompt for the chosen "
        "output (it must ask for the verdict, and the hint, in that form).",
    )


class JudgeConfig(Section):
    """Which judges score turns, and how the judging loop consumes its streams."""

    judges: dict[str, float] = Field(
        default_factory=lambda: {"feedback": 1.0, "rules": 1.0},
        description="Judge name -> weight; names come from the 'liveloop.judges' entry points.",
    )
    next_state_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Seconds to wait for a turn's next state before judging without one.",
    )
    max_attempts: int = Field(
        5, ge=1, description="Failed attempts before an entry goes to the dead-letter stream."
    )
    consumer: ConsumerSettings = Field(
        default_factory=lambda: consumer_defaults(claim_idle_ms=30_000, read_count=1000),
        description="The judging loop in consumer group `prm` (read_count: turns, feedback "
        "and fast judges).",
    )
    slow_read_count: int = Field(
        16,
        ge=1,
        description="Turns judged per batch when a judge awaits I/O (LLM judge): small batches "
        "commit early.",
    )
    judge_timeout_s: float = Field(
        120.0, gt=0, description="Longest one judge may take for one turn; longer is a failure."
    )
    retry_backoff_max_s: float = Field(
        300.0,
        gt=0,
        description="Retry delay of a failed turn doubles from consumer.claim_idle_ms up to this.",
    )
    state_ttl_s: int = Field(
        7 * 24 * 3600,
        ge=60,
        description="How long pairing state (waiting turns, early feedback) is kept in Redis.",
    )
    arrival_ttl_s: int = Field(
        3600,
        ge=60,
        description="How long a turn's request waits for a predecessor not seen yet (races).",
    )
    sweep_interval_s: float = Field(
        0.2, gt=0, description="How often turns past their next-state deadline are collected."
    )
    max_inflight_batches: int = Field(
        4, ge=1, description="Batches of turns being judged at once by one process."
    )
    lag_interval_s: float = Field(
        5.0, gt=0, description="How often consumer lag and pending counts are refreshed."
    )
    directive_hint_min_chars: int = Field(
        HINT_CHARS[0],
        ge=1,
        description="A directive hint shorter than this is trivial and dropped ('ok', 'n/a').",
    )
    directive_hint_max_chars: int = Field(
        HINT_CHARS[1],
        ge=20,
        description="A longer directive hint is cut to this (at a word boundary).",
    )
    rules: RulesJudgeConfig = Field(default_factory=RulesJudgeConfig)
    llm: LLMJudgeConfig = Field(default_factory=LLMJudgeConfig)
    judge_args: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Settings of plug-in judges, by judge name (`[prm.judge_args.<name>]`, "
        "`LIVELOOP_PRM__JUDGE_ARGS__<NAME>__<FIELD>`), checked at start-up against the "
        "judge's own settings model. The built-in judges have their sections: `rules`, `llm`.",
    )

    @field_validator("judge_args")
    @classmethod
    def _not_builtin_sections(cls, args: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name in args:
            if name in BUILTIN_SECTIONS:
                raise ValueError(f"judge {name!r} is configured in [prm.{name}]")
        return args

    def args_for(self, name: str) -> BaseModel | dict[str, Any]:
        """The settings given for judge `name`: its section, or its `judge_args` entry."""
        if name in BUILTIN_SECTIONS:
            section: BaseModel = getattr(self, name)
            return section
        return self.judge_args.get(name, {})

    def args_location(self, name: str) -> str:
        """Where judge `name`'s settings live, for error messages."""
        return f"prm.{name}" if name in BUILTIN_SECTIONS else f"prm.judge_args.{name}"

    @property
    def hint_chars(self) -> tuple[int, int]:
        """(shortest non-trivial, longest kept) length of a directive hint."""
        return self.directive_hint_min_chars, self.directive_hint_max_chars

    @field_validator("judges")
    @classmethod
    def _weights_positive(cls, judges: dict[str, float]) -> dict[str, float]:
        if not judges:
            raise ValueError("name at least one judge")
        for name, weight in judges.items():
            if not weight > 0:
                raise ValueError(f"weight of judge {name!r} must be > 0")
        return judges
