"""`bench/complaint_prompts.py`: the three messages of a pair ask the same question and differ
only in the topic the complaint names, and replies are read as the demo's users read them."""

from __future__ import annotations

from bench.complaint_prompts import ARMS, NAMING, make_pairs, rate_reply, summarize
from liveloop.demo.preferences import TOPICS, Question

CHESS = next(t for t in TOPICS if t.name == "chess")
RIVERS = next(t for t in TOPICS if t.name == "rivers")


def test_the_arms_differ_only_in_the_topic_the_complaint_names() -> None:
    pairs = make_pairs(12, seed=3)
    assert pairs == make_pairs(12, seed=3) and len(pairs) == 12
    assert all("{t}" in c for c in NAMING) and len(NAMING) >= 6
    for pair in pairs:
        assert pair.first.topic is not None and pair.then.topic is not None
        assert pair.first.topic != pair.then.topic
        question, previous, asked = (pair.message(arm) for arm in ARMS)
        assert question == pair.then.text
        assert previous.endswith(pair.then.text) and asked.endswith(pair.then.text)
        complaint_previous = previous[: -len(pair.then.text)]
        complaint_asked = asked[: -len(pair.then.text)]
        assert pair.first.topic.name in complaint_previous
        assert f" {pair.then.topic.name}" not in f" {complaint_previous}"
        assert complaint_asked == pair.complaint.format(t=pair.then.topic.name) + " "


def test_replies_are_read_by_the_topic_they_open_with_and_by_both_styles() -> None:
    pair = make_pairs(1, seed=0)[0]
    pair = type(pair)(
        Question("Explain rivers to me.", topic=RIVERS),
        Question("Describe chess.", topic=CHESS),
        NAMING[0],
    )
    on_question = (
        "Chess is a board game for two players. Each player moves pieces on a board of squares. "
        "A game of chess ends when a king cannot escape."
    )
    read = rate_reply(pair, on_question, brief_words=20, seed=1)
    assert read["opens_asked"] and not read["opens_previous"]
    assert read["explained"] == {"rating": 1.0, "reason": "pleased"}
    assert read["brief"] == {"rating": -1.0, "reason": "too_long"}
    earlier = "Rivers carry water from the hills down to the sea and shape the land they cross."
    read = rate_reply(pair, earlier, brief_words=20, seed=1)
    assert read["opens_previous"] and not read["opens_asked"]
    assert read["explained"]["rating"] == -1.0 and read["brief"]["rating"] == -1.0
    short = "Chess is a board game of kings, queens and careful plans."
    assert rate_reply(pair, short, brief_words=20, seed=1)["brief"]["rating"] == 1.0


def test_summary_gives_each_arm_its_ratings_and_opening_shares() -> None:
    def row(arm: str, asked: bool, rating: float, reason: str) -> dict[str, object]:
        style = {"rating": rating, "reason": reason}
        return {"arm": arm, "opens_asked": asked, "opens_previous": not asked,
                "brief": style, "explained": style}  # fmt: skip

    rows = [row("question", True, 1.0, "pleased"), row("question", True, -1.0, "short")]
    rows += [row("previous", False, -1.0, "off_topic"), row("previous", True, 1.0, "pleased")]
    out = summarize(rows)
    assert set(out) == {"question", "previous"}  # no replies in `asked`: no entry
    assert out["question"]["opens_asked"] == 1.0 and out["previous"]["opens_previous"] == 0.5
    assert out["previous"]["explained"]["mean_rating"] == 0.0
    assert out["previous"]["explained"]["reasons"] == {"off_topic": 0.5, "pleased": 0.5}
    assert out["question"]["brief"]["rating_se"] == 1.0
