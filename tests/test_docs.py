"""The README and docs/ are checked: their relative links resolve and the settings they name exist.

The convention for naming a setting is in `docs/development.md` and `tests/docs_check.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from liveloop.config import LiveLoopSettings
from tests.docs_check import check, link_problems, setting_exists, setting_problems, slug

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_docs_are_there() -> None:
    names = {path.name for path in DOCUMENTS}
    for expected in (
        "README.md",
        "learning.md",
        "engines.md",
        "security.md",
        "benchmarks.md",
        "development.md",
        "experiments.md",
        "operations.md",
    ):
        assert expected in names


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_every_relative_link_resolves(document: Path) -> None:
    problems = link_problems(document, document.read_text(encoding="utf-8"))
    assert not problems, "\n".join(map(str, problems))


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_every_setting_named_exists(document: Path) -> None:
    problems = setting_problems(
        document.name, document.read_text(encoding="utf-8"), LiveLoopSettings
    )
    assert not problems, "\n".join(map(str, problems))


class _Limits(BaseModel):
    per_minute: int = 0


class _Inner(BaseModel):
    lr: float = 1e-5
    keys: dict[str, _Limits] = {}
    args: dict[str, dict[str, int]] = {}


class _Other(BaseModel):
    kind: str = "x"
    import_path: str = ""


class _Root(BaseModel):
    model: str = "m"
    trainer: _Inner = _Inner()
    objective: _Inner | _Other | str = "rl"


def test_the_settings_walk_follows_models_unions_and_dicts() -> None:
    assert setting_exists(_Root, ["trainer", "lr"])
    assert setting_exists(_Root, ["trainer", "keys", '"key-1"', "per_minute"])
    assert setting_exists(_Root, ["trainer", "args", "<name>", "anything"])
    assert setting_exists(_Root, ["objective", "import_path"])
    assert setting_exists(_Root, ["objective", "lr"])
    assert not setting_exists(_Root, ["trainer", "lr", "deeper"])
    assert not setting_exists(_Root, ["trainer", "keys", "k", "burst"])
    assert not setting_exists(_Root, ["trainer", "<name>"])
    assert not setting_exists(_Root, ["objective", "options"])


def test_the_checker_finds_a_bad_link_and_a_bad_setting(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## Its second part\n")
    good = (
        "# Title\n\n## A `code` heading: with punctuation!\n\n"
        "See [other](other.md), [its part](other.md#its-second-part), [here](#title), "
        "[this](#a-code-heading-with-punctuation) and [the web](https://example.com/x.md).\n"
        'Set `trainer.lr`, `[trainer] lr = 1e-4`, `trainer.keys."key-1".per_minute`, '
        "`LIVELOOP_TRAINER__LR`, `LIVELOOP_MODEL` or `LIVELOOP_SGLANG_PYTHON`; "
        "`trainer/lr.py` and `model` are not settings.\n\n"
        '```toml\nmodel = "m"\n[trainer]\nlr = 1e-4\n```\n'
        "```python\n# not a heading\nx = '[dead](nowhere.md)'\n```\n"
    )
    bad = (
        "See [nowhere](missing.md), [a gone part](other.md#no-such-part) and [up](#nope).\n"
        "Set `trainer.learning_rate`, `LIVELOOP_TRAINER__LR_SCALE`, `LIVELOOP_MADE_UP`.\n\n"
        "```toml\n[trainer]\nmomentum = 0.9\n```\n"
    )
    (tmp_path / "good.md").write_text(good)
    (tmp_path / "bad.md").write_text(bad)

    assert check([tmp_path / "good.md"], _Root) == []
    messages = [problem.message for problem in check([tmp_path / "bad.md"], _Root)]
    assert messages == [
        "link to a missing file: missing.md",
        "link to a missing heading: other.md#no-such-part",
        "link to a missing heading: #nope",
        "no such setting: trainer.momentum",
        "no such setting: trainer.learning_rate",
        "no such setting: LIVELOOP_TRAINER__LR_SCALE",
        "no such setting: LIVELOOP_MADE_UP",
    ]


def test_a_made_up_setting_in_the_real_tree_is_refused() -> None:
    text = "`trainer.gate.max_kl`, `prm.rules.approval_score` and `trainer.gate.max_kll`."
    problems = setting_problems("inline", text, LiveLoopSettings)
    assert [p.message for p in problems] == ["no such setting: trainer.gate.max_kll"]


def test_anchors_follow_the_heading_rule() -> None:
    assert slug("What it guarantees") == "what-it-guarantees"
    assert slug("`trainer.gate`: the promotion gate") == "trainergate-the-promotion-gate"
    assert slug("Quick start (Python)") == "quick-start-python"
