"""The contract of a sense check, shared by the demo, the gate and the judge that does it.

A sense check reads (question, reply) pairs and says which replies answer their question
sensibly. The judging package implements it with an LLM (`liveloop.prm.sense`); the demo
receives one from the CLI (it never imports a loop), the promotion gate builds its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class SenseReport:
    """Which replies made sense (None: the judge gave no verdict), the share of those that
    did among the judged ones, and the seconds the judging took."""

    verdicts: list[bool | None]
    seconds: float

    @property
    def judged(self) -> int:
        """Replies the judge gave a verdict on."""
        return sum(v is not None for v in self.verdicts)

    @property
    def rate(self) -> float | None:
        """Share of the judged replies that answer their question sensibly."""
        judged = [v for v in self.verdicts if v is not None]
        return sum(judged) / len(judged) if judged else None

    def as_dict(self) -> dict[str, float | int | None]:
        """The figures a report keeps."""
        return {
            "sense_rate": self.rate,
            "sense_judged": self.judged,
            "sense_seconds": round(self.seconds, 2),
        }


class SenseCheck(Protocol):
    """Rates (question, reply) pairs; `aclose` releases its connections."""

    async def rate(self, pairs: Sequence[tuple[str, str]]) -> SenseReport:
        """A verdict per pair, in order."""
        ...

    async def aclose(self) -> None:
        """Release the client."""
        ...


# Builds a sense check for a judge endpoint (base URL ending in /v1) and a model name.
SenseCheckFactory = Callable[[str, str | None], SenseCheck]
