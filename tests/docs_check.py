"""Checks of the Markdown docs: relative links resolve, and every setting they name exists.

Why: the README and `docs/` name files, headings and settings that the code renames and
moves; a reader who follows a dead link or sets a setting that no longer exists gets
nothing, or a start-up error. The convention for naming a setting (stated in
`docs/development.md`) is what makes the second check possible:

- a backticked dotted path whose first part is a section of `LiveLoopSettings`
  (`trainer.gate.max_kl`, `collector.min_turns`), optionally as a TOML table header or
  assignment (`[trainer.gate]`, `[server] engine = "sglang"`,
  `trainer.lr = 1e-4`); `<name>` or a quoted key stands for a key of a table of
  your own (`prm.judge_args.<name>`, `server.key_limits."key-…"`);
- a `LIVELOOP_*` environment variable (`LIVELOOP_TRAINER__LR`: `__` between the parts of
  the path; `LIVELOOP_REDIS_URL`: a top-level setting), unless it is one of the deployment
  and test variables in `OTHER_VARIABLES`;
- every key of a fenced ```toml block.

A path exists when each part is a field of the model before it, following nested models,
union members, and the values of `dict` and `list` fields (a `dict` takes any key).
"""

from __future__ import annotations

import re
import tomllib
import types
import typing
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

# `LIVELOOP_*` variables that are not settings: compose and image build variables, and the
# switches of the test targets.
OTHER_VARIABLES = frozenset(
    {
        "LIVELOOP_BASE_IMAGE",
        "LIVELOOP_BIND",
        "LIVELOOP_CACHE_DIR",
        "LIVELOOP_CONFIG_FILE",
        "LIVELOOP_CPU_TRAINERS",
        "LIVELOOP_ENGINE",
        "LIVELOOP_IMAGE_PREFIX",
        "LIVELOOP_MODELS_DIR",
        "LIVELOOP_PIP_NO_INDEX",
        "LIVELOOP_PRELOAD_MODELS",
        "LIVELOOP_REQUIRE_OPS_TOOLS",
        "LIVELOOP_SGLANG_PYTHON",
        "LIVELOOP_SGLANG_REPLICAS",
        "LIVELOOP_SGLANG_TEST_URLS",
        "LIVELOOP_SGLANG_URLS",
        "LIVELOOP_TEST_DEPLOY",
        "LIVELOOP_TRAINER_GPUS",
    }
)
FILE_SUFFIXES = frozenset({"py", "md", "toml", "json", "png", "yml", "yaml", "txt", "sh", "env"})

_FENCE = re.compile(r"^(```|~~~)(\w*)[^\n]*\n(.*?)^\1[ \t]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s+(\S+)", re.MULTILINE)
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
_ENV = re.compile(r"\bLIVELOOP_(?:[A-Z0-9_]|<[A-Z0-9_]+>)+")
_PART = r'(?:[a-z_][a-z0-9_]*|<[^<>`]+>|"[^"`]*")'
_PATH = rf"{_PART}(?:\.{_PART})*"
_SETTING_SPAN = re.compile(
    rf"^(?:\[(?P<table>{_PATH})\]\s*(?P<key>{_PART})?|(?P<path>{_PATH}))\s*(?:=.*)?$",
    re.DOTALL,
)
_WILDCARD = re.compile(r'^(?:<[^<>]+>|"[^"]*")$')


@dataclass(frozen=True)
class Problem:
    """One thing wrong in a document: where, and what."""

    document: str
    message: str

    def __str__(self) -> str:
        return f"{self.document}: {self.message}"


# ---------------------------------------------------------------------------------- links


def slug(heading: str) -> str:
    """The anchor a heading gets (GitHub's rule: lower case, punctuation dropped, - for space)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading anchor of a document (repeated headings get -1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for match in _HEADING.finditer(strip_fences(markdown)):
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def strip_fences(markdown: str) -> str:
    """The text without fenced code blocks (their lines kept empty)."""
    return _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), markdown)


def links(markdown: str) -> list[str]:
    """The targets of the inline and reference links outside code."""
    prose = _CODE_SPAN.sub("", strip_fences(markdown))
    return [m.group(1) for m in _LINK.finditer(prose)] + _REF_LINK.findall(prose)


def link_problems(document: Path, markdown: str) -> list[Problem]:
    """Relative links whose file, or whose `#anchor` in a Markdown file, is not there."""
    problems = []
    for target in links(markdown):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
            continue  # http:, https:, mailto:
        path_part, _, anchor = target.partition("#")
        path = (document.parent / path_part).resolve() if path_part else document
        if not path.exists():
            problems.append(Problem(document.name, f"link to a missing file: {target}"))
        elif (
            anchor
            and path.suffix == ".md"
            and anchor not in anchors(path.read_text(encoding="utf-8"))
        ):
            problems.append(Problem(document.name, f"link to a missing heading: {target}"))
    return problems


# ------------------------------------------------------------------------------- settings


def _members(annotation: Any) -> Iterator[Any]:
    """The types a value of `annotation` may have (Annotated, unions and Optional opened)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        yield from _members(typing.get_args(annotation)[0])
    elif origin is typing.Union or origin is types.UnionType:
        for arg in typing.get_args(annotation):
            yield from _members(arg)
    else:
        yield annotation


def _step(annotation: Any, part: str) -> list[Any]:
    """The types found under `part` of a value of `annotation` (empty: no such key)."""
    found: list[Any] = []
    for member in _members(annotation):
        origin = typing.get_origin(member)
        args = typing.get_args(member)
        if member is Any:
            found.append(Any)
        elif isinstance(member, type) and issubclass(member, BaseModel):
            field = member.model_fields.get(part)
            if field is not None and not _WILDCARD.match(part):
                found.append(field.annotation)
        elif origin in (dict, typing.Mapping) or member is dict:
            found.append(args[1] if len(args) == 2 else Any)
        elif origin in (list, tuple, set, frozenset):
            for item in args:
                if item is not Ellipsis:
                    found.extend(_step(item, part))
    return found


def setting_exists(root: type[BaseModel], parts: Iterable[str]) -> bool:
    """Whether the path of keys `parts` leads somewhere in the settings model `root`."""
    current: list[Any] = [root]
    for part in parts:
        current = [t for annotation in current for t in _step(annotation, part)]
        if not current:
            return False
    return True


def split_path(path: str) -> list[str]:
    """`a.b."c.d".<e>` -> ['a', 'b', '"c.d"', '<e>']."""
    return re.findall(_PART, path)


def env_path(name: str) -> list[str]:
    """`LIVELOOP_TRAINER__GATE__MAX_KL` -> ['trainer', 'gate', 'max_kl']."""
    return [part.lower() for part in name.removeprefix("LIVELOOP_").split("__")]


def named_paths(markdown: str, sections: set[str]) -> Iterator[tuple[str, list[str]]]:
    """(as written, path) of every setting the document names, by the convention above."""
    for match in _FENCE.finditer(markdown):
        if match.group(2).lower() == "toml":
            yield from _toml_paths(match.group(3))
    prose = strip_fences(markdown)
    for span in _CODE_SPAN.finditer(prose):
        parsed = _SETTING_SPAN.match(span.group(2).strip())
        if parsed is None:
            continue
        written = parsed.group("table") or parsed.group("path")
        parts = split_path(written) + ([parsed.group("key")] if parsed.group("key") else [])
        if parts[0] in sections and parts[-1] not in FILE_SUFFIXES:
            yield span.group(2).strip(), parts
    for name in _ENV.findall(markdown):
        if name not in OTHER_VARIABLES:
            yield name, env_path(name)


def _toml_paths(block: str) -> Iterator[tuple[str, list[str]]]:
    try:
        table = tomllib.loads(block)
    except tomllib.TOMLDecodeError as exc:
        yield f"a toml block that does not parse ({exc})", ["<unreadable toml>"]
        return

    def walk(value: dict[str, Any], prefix: list[str]) -> Iterator[tuple[str, list[str]]]:
        for key, item in value.items():
            yield ".".join([*prefix, key]), [*prefix, key]
            if isinstance(item, dict):
                yield from walk(item, [*prefix, key])

    yield from walk(table, [])


def setting_problems(document: str, markdown: str, root: type[BaseModel]) -> list[Problem]:
    """Settings the document names that the settings model `root` does not have."""
    sections = {
        name
        for name, field in root.model_fields.items()
        if any(isinstance(m, type) and issubclass(m, BaseModel) for m in _members(field.annotation))
    }
    missing = [
        written
        for written, parts in named_paths(markdown, sections)
        if not setting_exists(root, parts)
    ]
    return [Problem(document, f"no such setting: {written}") for written in dict.fromkeys(missing)]


def check(documents: Iterable[Path], root: type[BaseModel]) -> list[Problem]:
    """Every link and setting problem of the given Markdown files."""
    problems = []
    for path in documents:
        text = path.read_text(encoding="utf-8")
        problems += link_problems(path, text)
        problems += setting_problems(path.name, text, root)
    return problems
