"""The tenants demo: house styles that conflict, the isolation checks read back from real
streams, the matrix report, and `liveloop demo --tenants` end to end on tiny-random."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest

from liveloop import bus
from liveloop.config import ConfigError, load_settings, presets
from liveloop.config.demo import DemoConfig
from liveloop.contracts import BatchSample, TrainingBatch
from liveloop.demo.preferences import TOPICS, Question
from liveloop.demo.report import JudgedTurn
from liveloop.demo.styles import house_style, make_tenants
from liveloop.demo.tenant_report import ScopeRun, headline, matrix, write_tenant_report
from liveloop.demo.tenants import _tenant_id, isolation_checks
from liveloop.valkey import free_port
from tests.test_up_and_demo import CLI

BRIEF_WORDS = DemoConfig().brief_words
BREAD = next(t for t in TOPICS if t.name == "bread")
ASK = Question("Tell me about bread.", topic=BREAD)
SHORT = "Bread is baked from flour, water and yeast in a hot oven."
LONG = (
    "Bread is baked from dough of flour and water. The dough rises with yeast before baking. "
    "Every culture has its own loaves, from flatbread to sourdough."
)


def _rate(style: int, reply: str) -> tuple[float, str]:
    tenants = make_tenants(3, 3, brief_words=BRIEF_WORDS)
    reaction = tenants[style].people[0].react(ASK, reply, random.Random(0))
    return reaction.rating, reaction.reason


def test_the_brief_and_the_explained_tenants_want_opposite_replies() -> None:
    assert _rate(0, SHORT) == (1.0, "pleased")
    assert _rate(0, LONG) == (-1.0, "too_long")
    assert _rate(1, SHORT) == (-1.0, "short")
    assert _rate(1, LONG) == (1.0, "pleased")
    opening_elsewhere = "It is made " + LONG.removeprefix("Bread is baked")
    assert _rate(1, opening_elsewhere) == (-1.0, "opening")
    assert _rate(1, "Bread bread bread bread. Bread bread. Bread bread.")[0] == -1.0  # nonsense


def test_the_brief_tenants_word_limit_is_a_setting() -> None:
    """The brief tenant's users hold demo.brief_words (20 unless set), held-out ones too."""
    seventeen = "Bread is baked from flour, water and yeast in a hot oven, and people eat it daily."
    assert _rate(0, seventeen) == (1.0, "pleased")
    (tight,) = make_tenants(1, 1, brief_words=7)
    assert tight.people[0].react(ASK, SHORT, random.Random(0)).reason == "too_long"
    assert house_style(0, True, 12).limit == 12
    assert load_settings(model="tiny-random").demo.brief_words == 20


def test_tenants_get_their_own_keys_and_share_out_the_users() -> None:
    tenants = make_tenants(4, 9, brief_words=BRIEF_WORDS)
    assert [t.style for t in tenants] == ["brief", "explained", "weather_tool", "brief"]
    assert len({t.api_key for t in tenants}) == 4
    assert [len(t.people) for t in tenants] == [3, 2, 2, 2]
    assert all(p.name == t.people[0].name for t in tenants for p in t.people)
    weather = tenants[2].people[0].ask(random.Random(1))
    assert weather.wants_tool


def test_users_per_style_sizes_each_tenant_by_its_style() -> None:
    """With demo.users_per_style a tenant gets its style's count, and more tenants than
    styles repeat the counts with the styles; the preset shares nine users out in turn."""
    counts = {"brief": 4, "explained": 2, "weather_tool": 1}
    tenants = make_tenants(4, 9, brief_words=BRIEF_WORDS, users_per_style=counts)
    assert [len(t.people) for t in tenants] == [4, 2, 1, 4]
    assert all(p.name == t.style for t in tenants for p in t.people)
    preset = load_settings(presets.preset_path("tenants")).demo
    assert preset.users == 9 and preset.users_per_style == {}
    with pytest.raises(ConfigError, match=r"users_per_style.*missing: weather_tool"):
        load_settings(model="tiny-random", demo={"users_per_style": {"brief": 2, "explained": 2}})
    with pytest.raises(ConfigError, match=r"users_per_style.*at least one user"):
        load_settings(
            model="tiny-random",
            demo={"users_per_style": {"brief": 2, "explained": 0, "weather_tool": 1}},
        )


def _turn(key: str, tenant: str, adapter: str | None) -> JudgedTurn:
    return JudgedTurn(0.0, 1, 3, 3, 0.0, "main", tenant=tenant, adapter=adapter, key=key)


def _batch(batch_id: str, tenant: str | None, keys: list[str]) -> TrainingBatch:
    one = {"prompt_token_ids": [1], "completion_token_ids": [2], "logprobs": [-1.0],
           "versions": [0], "advantage": 1.0, "score": 1.0}  # fmt: skip
    samples = [BatchSample(key=k, **one) for k in keys]
    return TrainingBatch(batch_id=batch_id, trainer_version=0, num_tokens=2, samples=samples,
                         tenant=tenant)  # fmt: skip


async def test_isolation_checks_find_a_foreign_adapter_and_a_mixed_batch(
    redis_url: str, tmp_path: Path
) -> None:
    a, b = make_tenants(2, 2, brief_words=BRIEF_WORDS)
    ta, tb = _tenant_id(a), _tenant_id(b)
    turns = [_turn("s1:0:0", ta, ta), _turn("s2:0:0", tb, None), _turn("s2:1:0", tb, None)]
    client = await bus.connect(redis_url)
    try:
        await bus.publish(client, bus.BATCHES, _batch("one", ta, ["s1:0:0"]))
        await bus.publish(client, bus.BATCHES, _batch("two", tb, ["s2:0:0", "s2:1:0"]))
        clean = isolation_checks(redis_url, tmp_path, turns, [a, b], "tenant")
        assert clean["passed"] and clean["batches_checked"] == 2 and clean["turns_checked"] == 3
        await bus.publish(client, bus.BATCHES, _batch("three", tb, ["s2:1:0", "s1:0:0"]))
    finally:
        await client.aclose()
    foreign = [*turns, _turn("s2:2:0", tb, ta)]  # b's turn served on a's adapter
    found = isolation_checks(redis_url, tmp_path, foreign, [a, b], "tenant")
    assert not found["passed"]
    assert found["served_by_another_tenants_adapter"] == 1
    assert found["batches_mixing_tenants"] == 1
    shared = isolation_checks(redis_url, tmp_path, turns, [a, b], "shared")
    assert shared["passed"]  # shared scope's batches mix tenants by design


def _figures(first: float, last: float, kept: bool = True, se: float = 0.1) -> dict[str, object]:
    return {
        "turns": 100, "window_turns": 32, "reward_first_window": first,
        "reward_last_window": last, "gain": last - first, "gain_se": se, "versions": [0, 1],
        "held_out_reward": {"base": first, "final": last},
        "quality_kept": {"topic_rate": kept, "symbols": True, "non_answers": True},
        "same_questions": [{"question": "Tell me about bread.", "reply": "Bread.", "version": 1}],
    }  # fmt: skip


def test_the_matrix_compares_each_tenants_gain_across_scopes(tmp_path: Path) -> None:
    tenants = make_tenants(3, 3, brief_words=BRIEF_WORDS)
    labels = [t.label for t in tenants]
    iso = {"passed": True, "turns_checked": 9, "served_by_another_tenants_adapter": 0,
           "batches_checked": 2, "batches_mixing_tenants": 0}  # fmt: skip
    own = [_figures(-0.8, 0.1), _figures(-0.5, 0.2), _figures(-1, -1)]
    one = [_figures(-0.8, -0.4), _figures(-0.5, -0.4), _figures(-1, -1)]
    tenant = ScopeRun("tenant", dict(zip(labels, own, strict=True)), iso)
    shared = ScopeRun("shared", dict(zip(labels, one, strict=True)), iso)
    rows = matrix(tenants, [tenant, shared])
    assert rows[0]["gain_difference"] == pytest.approx(0.5)
    assert rows[1]["gain_difference"] == pytest.approx(0.6)
    tenant.tenants[labels[1]]["gain_se"] = 0.2  # errors of independent runs add in squares
    rows = matrix(tenants, [tenant, shared])
    assert rows[1]["gain_difference_se"] == pytest.approx((0.2**2 + 0.1**2) ** 0.5)
    tenant.tenants[labels[0]]["held_out_reward"] = {"base": -0.9, "final": 0.0}
    rows = matrix(tenants, [tenant, shared])
    assert rows[0]["held_out_gain_difference"] == pytest.approx(0.9 - 0.4)
    assert rows[0]["gain_difference"] == pytest.approx(0.5)  # the live windows' alone
    assert headline(rows, [tenant, shared])["tenant_scope_beats_shared"] is True
    shared.tenants[labels[1]] = _figures(-0.5, 0.0)  # explained gains nearly as much shared
    assert (
        headline(matrix(tenants, [tenant, shared]), [tenant, shared])["tenant_scope_beats_shared"]
        is False
    )
    shared.tenants[labels[1]] = _figures(-0.5, -0.4, kept=False)
    top = headline(matrix(tenants, [tenant, shared]), [tenant, shared])
    assert top["quality_kept"] is False and top["tenant_scope_beats_shared"] is False
    tenant.tenants[labels[0]]["versions"] = [0, 2, 5, 9]  # the base is not a trained version
    settings = load_settings(model="tiny-random", data_dir=tmp_path)
    paths = write_tenant_report(tmp_path, settings, tenants, [tenant, shared])
    markdown = paths["md"].read_text()
    assert "| tenant 1 (brief) | -0.80 -> +0.10 (gain +0.90, 100 turns, 3 versions;" in markdown
    assert "-0.80 -> -0.40 (gain +0.40, 100 turns, 1 version; quality kept)" in markdown
    assert "| +0.50 ± 0.14 |" in markdown  # the live difference, with its standard error
    assert (
        "| tenant 1 (brief) | -0.90 -> +0.00 (gain +0.90) | -0.80 -> -0.40 (gain +0.40) | +0.50 |"
        in markdown
    )
    assert "Held-out users' gain differences" in markdown
    assert "lost: topic_rate" in markdown
    assert "3 tenants, 3 users (1 brief, 1 explained, 1 weather_tool)" in markdown
    written = json.loads(paths["json"].read_text())
    assert written["matrix"][0]["style"] == "brief" and written["users"] == 3


@pytest.mark.slow
@pytest.mark.solo
def test_tenants_demo_on_tiny_random_trains_each_tenants_adapter_apart(tmp_path: Path) -> None:
    """`liveloop demo --tenants 2 --scope tenant` end to end (tiny-random with the tenants
    preset's adapters): each tenant's turns judged, its own adapter trained and served to it,
    held-out users of each style, isolation read back from the streams. Tiny-random's
    replies of a few words please brief users at 8 words about half the time (a signal to
    learn from) and never please explained users (no signal: no adapter)."""
    cmd = [*CLI, "demo", "--tenants", "2", "--scope", "tenant", "--model", "tiny-random",
           "--minutes", "0.75", "--port", str(free_port()), "--data-dir", str(tmp_path),
           "--quiet"]  # fmt: skip
    settings_env = {"LIVELOOP_TRAINER__LR": "0.02", "LIVELOOP_DEMO__TURNS_PER_UPDATE": "8",
                    "LIVELOOP_DEMO__BRIEF_WORDS": "8"}  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **settings_env})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert list(report["scopes"]) == ["tenant"]
    iso = report["scopes"]["tenant"]["isolation"]
    assert iso["passed"] and iso["turns_checked"] > 0 and iso["batches_checked"] > 0, iso
    rows = report["matrix"]
    assert [r["style"] for r in rows] == ["brief", "explained"]
    for row in rows:
        figures = row["tenant"]
        assert figures["turns"] > 0 and figures["held_out_reward"]["base"] is not None
        assert len(figures["same_questions"]) == 3
        assert sum(figures["reactions"]["first"].values()) == pytest.approx(1.0)
    brief, explained = (r["tenant"] for r in rows)
    assert max(brief["versions"]) > 0, brief  # served versions of its own adapter
    assert -1.0 < brief["reward_first_window"] < 1.0, brief  # pleased and not: a signal
    # Every explained turn scored -1: each was flat against the tenant's baselines (the
    # first of each, with nothing to be measured against, too), so no update was made.
    assert explained["reward_first_window"] == explained["reward_last_window"] == -1.0
    assert explained["versions"] == [0], explained
    assert "## Judged reward per tenant" in (tmp_path / "demo" / "report.md").read_text()


def test_tenants_demo_without_lora_says_which_setting_to_change(tmp_path: Path) -> None:
    cmd = [*CLI, "demo", "--tenants", "2", "--preset", "tiny-random", "--data-dir", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "trainer.lora.enabled = true" in done.stderr
    assert not (tmp_path / "demo").exists()
