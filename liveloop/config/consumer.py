"""How a loop reads its input stream in a Redis consumer group (`prm.consumer`,
`collector.consumer`, `trainer.consumer`): one section type, with each loop's defaults."""

from pydantic import Field

from liveloop.config.base import Section


class ConsumerSettings(Section):
    """This process's name in its consumer group, how many entries it reads at a time, and
    when entries pending on a consumer that stopped answering are taken over."""

    name: str | None = Field(
        None, description="Consumer name in the loop's group (default: host-pid)."
    )
    claim_idle_ms: int = Field(
        30_000,
        ge=100,
        description="Entries pending this long on another consumer are reclaimed (it is "
        "taken for dead); a failed entry is retried after this long, doubling each time.",
    )
    read_count: int = Field(100, ge=1, description="Entries read per XREADGROUP call.")


def consumer_defaults(claim_idle_ms: int, read_count: int) -> ConsumerSettings:
    """A loop's consumer section with its own defaults."""
    return ConsumerSettings(claim_idle_ms=claim_idle_ms, read_count=read_count)
