"""The sense judge: an LLM asked whether each reply answers its question sensibly.

Its verdicts come through the `llm` judge's client from a stand-in judge endpoint (a real
OpenAI-compatible HTTP server with scripted votes, `tests.test_prm_llm`); the demo's judge
server is a real `liveloop serve` process; the gate probes a real (tiny) policy.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from liveloop.config import load_settings
from liveloop.config.sense import SenseJudgeSettings
from liveloop.demo.report import headline
from liveloop.demo.sense_judge import gate_env, rate_held_out, sense_judge_server
from liveloop.prm.sense import SENSE_PROMPT, LLMSenseCheck, sense_check_factory
from liveloop.trainer.policy import load_policy
from tests.test_prm_llm import StandInJudgeEndpoint
from tests.test_quality_and_gate import gate_of

BREAD = "Tell me about bread."


@pytest.fixture
def endpoint() -> Iterator[StandInJudgeEndpoint]:
    with StandInJudgeEndpoint() as server:
        yield server


def _check(endpoint: StandInJudgeEndpoint, **kw: Any) -> LLMSenseCheck:
    settings = SenseJudgeSettings(base_url=f"http://127.0.0.1:{endpoint.port}/v1", **kw)
    return LLMSenseCheck(settings, str(settings.base_url), "judge-model")


async def test_sense_verdicts_come_from_the_llm_judge(endpoint: StandInJudgeEndpoint) -> None:
    check = _check(endpoint)
    pairs = [
        (BREAD, "Bread is dough of flour and water, left to rise and baked. SCRIPT:good"),
        (BREAD, "Bread: A Recipe for Endless Harvest SCRIPT:bad"),
        (BREAD, "SCRIPT:garbage"),  # no valid vote: no verdict, not counted
    ]
    try:
        report = await check.rate(pairs)
    finally:
        await check.aclose()
    assert report.verdicts == [True, False, None]
    assert (report.judged, report.rate) == (2, 0.5)
    assert report.as_dict()["sense_judged"] == 2 and report.seconds > 0
    body = endpoint.requests[0]["body"]
    assert body["messages"][0] == {"role": "system", "content": SENSE_PROMPT}
    assert body["messages"][-1]["role"] == "user" and BREAD in body["messages"][-1]["content"]
    shown = [m["content"] for m in body["messages"] if m["role"] == "assistant"]
    assert set(shown) == {"GOOD", "BAD"}  # worked examples of both verdicts come first
    assert (body["temperature"], body["max_tokens"], body["model"]) == (0.0, 4, "judge-model")
    # the judge's own requests are never training turns of the server it asks
    assert endpoint.requests[0]["headers"]["x-liveloop-train"] == "false"


async def test_the_gate_measures_sense_and_refuses_a_version_that_loses_it(
    endpoint: StandInJudgeEndpoint,
) -> None:
    settings = load_settings(model="tiny-random", trainer={"gate": {"probe_users": 3}})
    policy = load_policy("tiny-random", "cpu", settings.trainer.lora, with_reference=True)
    gate = gate_of(settings)
    gate.sense = _check(endpoint)
    await gate.start(policy, 0)
    assert gate.version0 is not None and gate.serving is not None
    assert gate.version0.sense_rate == 1.0 and gate.version0.sense_seconds > 0
    asked = len(endpoint.requests)
    assert asked == gate.version0.probes == 3  # one judge request per probe reply
    same = await gate.probe(policy, 1)
    assert gate.decide(same).accepted and len(endpoint.requests) == 2 * asked
    # 100% -> 0%: every probe lost its sense (3 of 3 worse, none better: 3 / sqrt(3) = 1.73
    # standard errors, beyond noise)
    nonsense = [mark.model_copy(update={"sensible": False}) for mark in same.marks]
    lost = same.model_copy(update={"sense_rate": 0.0, "marks": nonsense})
    refused = gate.decide(lost)
    assert not refused.accepted and "sense judge" in str(refused.reason)
    assert gate.decide(same.model_copy(update={"sense_rate": 0.85})).accepted
    # 100% -> 33%: two of three, within noise (2 / sqrt(2) = 1.41); the bound alone refuses
    two = nonsense[:2] + same.marks[2:]
    assert gate.decide(same.model_copy(update={"sense_rate": 1 / 3, "marks": two})).accepted
    alone = gate.cfg.model_copy(update={"loss_z": None})
    gate.cfg, paired = alone, gate.cfg
    assert not gate.decide(same.model_copy(update={"sense_rate": 1 / 3, "marks": two})).accepted
    gate.cfg = paired
    gate.cfg = gate.cfg.model_copy(update={"max_sense_drop": None})
    assert gate.decide(lost).accepted  # measured, not bounded
    assert gate.sense is not None
    await gate.sense.aclose()


@pytest.mark.slow
def test_the_demo_serves_its_sense_judge_and_rates_held_out_replies(tmp_path: Path) -> None:
    """A real `liveloop serve` of the judge model (tiny-random: its votes are noise, so some
    or all give no verdict), asked about every held-out reply, then stopped."""
    settings = load_settings(
        model="tiny-random", data_dir=tmp_path, demo={"sense_model": "tiny-random"}
    )
    evals: dict[str, Any] = {
        "version 0": {"replies": [{"question": BREAD, "reply": "Bread is baked dough."}] * 2},
        "version 3 (final)": {"replies": [{"question": BREAD, "reply": "owl owl owl"}]},
    }
    with sense_judge_server(settings, tmp_path / "run") as url:
        assert url is not None and url.endswith("/v1")
        assert gate_env(settings, url) == {}  # demo.sense_gate is off
        sense = settings.trainer.gate.sense
        rate_held_out(evals, url, None, sense_check_factory(sense))
        models = httpx.get(url + "/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == ["tiny-random"]
    for row in evals.values():
        verdicts = [reply["sensible"] for reply in row["replies"]]
        assert row["sense_judged"] == sum(v is not None for v in verdicts)
        assert row["sense_seconds"] > 0
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/models", timeout=2)  # the judge server is gone
    on = settings.model_copy(update={"demo": settings.demo.model_copy(update={"sense_gate": True})})
    assert gate_env(on, url)["LIVELOOP_TRAINER__GATE__SENSE__BASE_URL"] == url


def test_the_report_shows_sense_at_version_0_and_final() -> None:
    summary: dict[str, Any] = {
        "improvement": 0.3,
        "eval": {
            "version 0": {"sense_rate": 0.75, "non_answer_share": 0.0},
            "version 5 (final)": {"sense_rate": 0.5, "non_answer_share": 0.0},
        },
    }
    out = headline(summary)
    assert out["sense_rate"] == {"version 0": 0.75, "final": 0.5}
    assert out["quality_kept"]["sense"] is False  # lost more than 10 points
    summary["eval"]["version 5 (final)"]["sense_rate"] = 0.7
    assert headline(summary)["quality_kept"]["sense"] is True
    del summary["eval"]["version 0"]["sense_rate"]
    assert "sense" not in headline(summary)["quality_kept"]  # not measured: no check
