"""How a contract travels in a stream entry: a `data` field of JSON plus small index fields.

Every entry is readable with a plain XRANGE; readers decode `data` through the contract
models (`liveloop.contracts`), never with a bare `json.loads`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)


def encode(payload: BaseModel, **index: str | int | float) -> dict[str, str]:
    """Stream fields for a payload: `data` (JSON) plus small index fields."""
    fields = {"data": payload.model_dump_json()}
    fields.update({k: str(v) for k, v in index.items()})
    return fields


def decode(fields: Mapping[Any, Any], model: type[M]) -> M:
    """Parse the `data` field of an entry into a contract model (ValueError if malformed)."""
    raw = fields.get("data") if "data" in fields else fields.get(b"data")
    if raw is None:
        raise ValueError("stream entry has no 'data' field")
    return model.model_validate_json(raw)


def decode_entries(entries: Iterable[Any], model: type[M]) -> Iterator[M]:
    """The readable entries of an XRANGE/XREVRANGE reply, in order, as contract models.

    A malformed entry is logged and skipped: a bad write never hides the entries around it.
    """
    for entry_id, fields in entries:
        try:
            yield decode(fields or {}, model)
        except (ValidationError, ValueError) as exc:
            log.warning("ignoring malformed %s entry %s: %s", model.__name__, entry_id, exc)


@dataclass
class Entry:
    """One stream entry as delivered to a consumer."""

    id: str
    fields: dict[str, str]

    def parse(self, model: type[M]) -> M:
        """The entry's `data` as a contract model."""
        return decode(self.fields, model)
