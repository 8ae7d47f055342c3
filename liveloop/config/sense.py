"""Settings of the sense judge: an LLM asked whether a reply answers its question at all."""

from pydantic import Field

from liveloop.config.base import Section


class SenseJudgeSettings(Section):
    """A judge model asked, for each (question, reply), whether the reply is a sensible
    answer: word-level measures miss fluent nonsense ("Bread: A Recipe for Endless Harvest"
    for "Tell me about bread."), a model that reads the pair does not. It is the `llm`
    judge's client with its own instructions, pointed at any OpenAI-compatible endpoint."""

    base_url: str | None = Field(
        None,
        description="OpenAI-compatible base URL (ending in /v1) serving the judge model; "
        "unset = no sense judge.",
    )
    model: str | None = Field(
        None, description="Model name to ask (default: the first model the endpoint lists)."
    )
    api_key: str = Field("none", description="API key for the judge endpoint.")
    votes: int = Field(
        1,
        ge=1,
        le=15,
        description="Votes per reply; one vote is asked greedily (temperature 0), several at "
        "temperature 0.7, and the majority wins.",
    )
    max_tokens: int = Field(4, ge=1, description="Completion budget of one vote (one word).")
    timeout_s: float = Field(120.0, gt=0, description="Timeout of one judge request.")
    concurrency: int = Field(2, ge=1, description="Most judge requests in flight.")
    max_chars: int = Field(
        2000, ge=100, description="The question and the reply are each cut to this."
    )
