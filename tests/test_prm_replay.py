"""Replay into a separate stream, and a custom judge installed as a package and used by name."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import redis
import redis.asyncio as aredis

from liveloop.config import ConfigError, load_settings
from liveloop.contracts import Feedback, ScoredTurn, TurnRecord
from liveloop.prm.main import ReplayOptions, run
from tests.synthetic import conversation, make_turn, user, write_turns
from tests.test_prm_processes import ROOT, judge_env, stop

LONG_REPLY = " ".join(["word"] * 120)


def write(redis_url: str, turns: list[TurnRecord], feedback: Sequence[Feedback] = ()) -> None:
    async def go() -> None:
        client = aredis.from_url(redis_url, decode_responses=True)
        await write_turns(client, turns)
        for fb in feedback:
            await client.xadd("liveloop:feedback", {"data": fb.model_dump_json()})
        await client.aclose()

    asyncio.run(go())


def entries(client: redis.Redis, stream: str) -> dict[str, ScoredTurn]:
    out = {}
    for _id, fields in client.xrange(stream):
        turn = ScoredTurn.model_validate_json(fields["data"])
        out[turn.key] = turn
    return out


def test_replay_rescoring_into_separate_stream(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    a = conversation("a", [user("hi"), user("no, that's wrong"), user("thanks!")])
    side = make_turn("a", 7, [user("summarise")], "summary", turn_type="side")
    b = conversation("b", [user("hello")])
    write(
        redis_url, [*a, side, *b], [Feedback(session_id="b", turn_index=0, score=0.25, tenant="t")]
    )
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    settings = load_settings(redis_url=redis_url, prm={"rules": {"timeout_score": 0.0}})

    run(
        settings.shared(),
        settings.prm,
        replay=ReplayOptions(judges=["rules"], from_id="-", to_stream="replay-rules"),
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["replay"]["scored"] == 4 and summary["replay"]["side"] == 1
    got = entries(client, "liveloop:replay-rules")
    assert {k: (v.score, v.signal, v.judge) for k, v in got.items()} == {
        "a:0:0": (-1.0, "next_turn", "rules"),
        "a:1:0": (1.0, "next_turn", "rules"),
        "a:2:0": (0.0, "timeout", "rules"),
        "b:0:0": (0.25, "feedback", "rules"),
    }
    assert got["a:0:0"].completion_token_ids == a[0].completion_token_ids
    assert client.xlen("liveloop:scored") == 0  # the live stream is untouched
    assert client.exists("liveloop:turns") and not client.xinfo_groups("liveloop:turns")

    run(
        settings.shared(),
        settings.prm,
        replay=ReplayOptions(judges=["rules"], from_id="-", to_stream="replay-rules"),
    )
    assert json.loads(capsys.readouterr().out)["replay"]["duplicate"] == 4
    assert client.xlen("liveloop:replay-rules") == 4  # re-running adds nothing

    third_id = client.xrange("liveloop:turns")[2][0]  # a:2 onwards
    run(
        settings.shared(),
        settings.prm,
        replay=ReplayOptions(judges=["feedback", "rules"], from_id=third_id, to_stream="since"),
    )
    assert sorted(entries(client, "liveloop:since")) == ["a:2:0", "b:0:0"]
    with pytest.raises(ConfigError, match="separate stream"):
        run(
            settings.shared(),
            settings.prm,
            replay=ReplayOptions(judges=["rules"], to_stream="scored"),
        )


@pytest.fixture(scope="module")
def custom_judge_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The examples/custom-judge package, pip-installed into a directory of its own."""
    tmp = tmp_path_factory.mktemp("custom-judge")
    source = tmp / "src"
    shutil.copytree(ROOT / "examples" / "custom-judge", source)
    target = tmp / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), str(source)],
        check=True,
        timeout=300,
    )  # fmt: skip
    assert list(target.glob("liveloop_custom_judge-*.dist-info/entry_points.txt"))
    return target


def test_custom_judge_installed_and_used_by_name(redis_url: str, custom_judge_path: Path) -> None:
    # The judge's own setting, from [prm.judge_args.concise] (here its environment variable).
    env = judge_env(redis_url, LIVELOOP_PRM__JUDGE_ARGS__CONCISE__WORDS="40")
    env["PYTHONPATH"] = f"{custom_judge_path}:{env['PYTHONPATH']}"
    turns = conversation("r", [user("q1"), user("q2")], replies=["short answer", LONG_REPLY])
    write(redis_url, turns)
    client = redis.Redis.from_url(redis_url, decode_responses=True)

    replay = subprocess.run(
        [sys.executable, "-m", "liveloop.cli", "judge", "--replay", "--judge", "concise",
         "--to-stream", "concise"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert replay.returncode == 0, replay.stderr
    got = entries(client, "liveloop:concise")
    assert got["r:0:0"].judge == "concise" and got["r:0:0"].score == 1.0
    words = len(LONG_REPLY.split())
    assert got["r:1:0"].score == pytest.approx(1 - 2 * (words - 40) / (3 * 40))

    env["LIVELOOP_PRM__JUDGES"] = json.dumps({"concise": 1.0})
    live = subprocess.Popen([sys.executable, "-m", "liveloop.cli", "judge"], env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while client.xlen("liveloop:scored") < 2:
            assert time.monotonic() < deadline and live.poll() is None
            time.sleep(0.05)
    finally:
        stop(live)
    scored = entries(client, "liveloop:scored")
    assert {k: (v.judge, v.signal) for k, v in scored.items()} == {
        "r:0:0": ("concise", "next_turn"),
        "r:1:0": ("concise", "timeout"),
    }
