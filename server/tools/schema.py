"""JSON-schema adjustments made before a schema goes to the grammar library.

xgrammar (0.2.x) compiles a string with `minLength`/`maxLength` into a character class that
lets raw control characters (a tab, U+0012, ...) into the string, which strict JSON parsers
then refuse. Such strings are rewritten into the equivalent `pattern` (the same length bounds,
no escapes, as xgrammar's own rule) minus the control characters.
"""

from __future__ import annotations

from typing import Any

# Keys whose values are data, not subschemas: never rewritten.
DATA_KEYS = frozenset({"enum", "const", "default", "examples", "required"})
PLAIN_CHARACTER = r'[^"\\\u0000-\u001f]'


def bounded_strings_as_patterns(schema: Any) -> Any:
    """A copy of `schema` with every length-bounded plain string schema turned into a pattern."""
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        key: value if key in DATA_KEYS else bounded_strings_as_patterns(value)
        for key, value in schema.items()
    }
    if _is_bounded_plain_string(out):
        low = int(out.pop("minLength", 0))
        high = out.pop("maxLength", None)
        out["pattern"] = f"^{PLAIN_CHARACTER}{{{low},{'' if high is None else int(high)}}}$"
    return out


def _is_bounded_plain_string(schema: dict[str, Any]) -> bool:
    if schema.get("type") != "string" or not ("minLength" in schema or "maxLength" in schema):
        return False
    if any(key in schema for key in ("pattern", "format", "enum", "const")):
        return False
    return all(
        isinstance(schema.get(key, 0), int) and schema.get(key, 0) >= 0
        for key in ("minLength", "maxLength")
    )
