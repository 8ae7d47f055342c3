"""Simulated users react like people and cannot be gamed; the rules judge reads them right."""

from __future__ import annotations

import random

import pytest

from liveloop.cli import build_parser, settings_from_args
from liveloop.config import ConfigError
from liveloop.demo import measures, styles
from liveloop.demo import preferences as prefs
from liveloop.demo.preferences import (
    TOPICS,
    OneSentence,
    Opening,
    Question,
    WeatherAsker,
    WordLimit,
    make_population,
)
from liveloop.prm.judges.rules import RulesJudge
from liveloop.reading import Lexicon, distinct_n, letter_words, read_reply

BEES = next(t for t in TOPICS if t.name == "bees")
BREAD = next(t for t in TOPICS if t.name == "bread")
ASK_BEES = Question("Tell me about bees.", topic=BEES)
ON_TOPIC_SHORT = "Bees are insects that make honey."
LONG = (
    "Bees are flying insects closely related to wasps and ants, known for their role in "
    "pollination and, in the case of the best-known bee species, the western honey bee, for "
    "producing honey and beeswax in large colonies."
)


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        ("🌱🌱🌵🌵⬉🌌🌮🌱🌵🌾🌢", "symbols"),  # an emoji run is not "one word"
        ("🐝 🐝 🐝 honey 🐝 🐝", "symbols"),
        ("Liahousisala\nruhaman\ntahi hai mulakah", "nonsense"),  # letters, but no English
        ("", "nonsense"),
        ("bees bees bees bees bees bees", "repetitive"),
        ("Bees make honey. Bees make honey. Bees make honey. Bees make honey.", "repetitive"),
        ("<b>bees</b> <i>honey</i> <div>hive</div> <p>x</p>", "markup"),
        # An English answer that slides into another script, even for one word (a drifted
        # Qwen's "21摄氏度"); accented Latin letters are fine (see below).
        ("Bees make honey in the hive at 21摄氏度 in summer.", "foreign"),
        ("Пчёлы make honey.", "foreign"),
        ("Trains run on rails across the whole country.", "off_topic"),
        # Word salad with the topic in it (a drifted policy's replies): listed but rare or
        # invented words, which the English word list alone let through.
        ("Bees, honey, aland, sanit, shezha, fok and the hive of the earth.", "nonsense"),
        ("The bees have a massive coterodyne: Dunport Kelso's snusloliasi honey.", "nonsense"),
    ],
)
def test_non_answers_get_a_complaint_never_thanks(reply: str, reason: str) -> None:
    rng = random.Random(1)
    for person in (WordLimit(30), Opening(30), OneSentence(30)):
        reaction = person.react(ASK_BEES, reply, rng)
        assert reaction.rating == -1.0 and reaction.reason == reason, (person, reaction)
        assert not any(word in reaction.text.lower() for word in ("thank", "perfect", "great"))


@pytest.mark.parametrize(
    ("question", "reply"),
    [
        # the topic and an echo of a word limit (a policy found this)
        (Question("Why do people like bread?", BREAD), "Bread.  30 words."),
        (ASK_BEES, "Bees. Short answer."),
        (ASK_BEES, "Bees, honey, hive, pollen."),  # only the topic's own words
        (ASK_BEES, "Bees are good."),  # two content words
        (ASK_BEES, "Bees are like meetitoun."),  # an invented word says nothing
    ],
)
def test_an_answer_that_names_the_topic_but_says_nothing_is_not_thanked(
    question: Question, reply: str
) -> None:
    for person in (WordLimit(30), Opening(30), OneSentence(30)):
        reaction = person.react(question, reply, random.Random(2))
        assert (reaction.rating, reaction.reason) == (-1.0, "thin"), (person, reaction)
        assert not read_reply(reply, question.topic.forms if question.topic else None).no_answer


def _ask(name: str) -> Question:
    return Question(f"Tell me about {name}.", topic=next(t for t in TOPICS if t.name == name))


@pytest.mark.parametrize(
    ("topic", "reply"),
    [
        # another topic first, as often or more (the first, served by a drifting smollm2, was
        # rated +1 before)
        ("volcanoes", "Bees aren't volcanoes, but they're closely related."),
        ("maps", "The ocean offers numerous reasons why people love maps."),
        ("bees", "Bees visit the river, and rivers and streams are full of fish."),
    ],
)
def test_a_reply_that_another_topic_leads_is_off_topic(topic: str, reply: str) -> None:
    question = _ask(topic)
    for person in (WordLimit(30), Opening(30), styles.Explained()):
        reaction = person.react(question, reply, random.Random(3))
        assert (reaction.rating, reaction.reason) == (-1.0, "off_topic"), (person, reaction)
    assert measures.reply_quality([(question.text, reply)])["topic_rate"] == 0.0
    # The gate reads replies without the demo's list of topics: it still sees the topic named.
    assert read_reply(reply, question.topic.forms if question.topic else None).on_topic


@pytest.mark.parametrize(
    ("topic", "reply"),
    [
        ("rivers", "Rivers carry rain water down to the sea."),  # the topic leads, others follow
        # a possessive names the topic too (before, "waves" led this one)
        ("rivers", "A river's banks hold waves, and the river flows on to the plains."),
        # forms the two topics share ("brewed") count for the topic asked
        ("tea", "Tea is brewed from leaves, much as coffee beans are brewed."),
    ],
)
def test_a_reply_that_mentions_another_topic_in_passing_stays_on_topic(
    topic: str, reply: str
) -> None:
    reaction = WordLimit(30).react(_ask(topic), reply, random.Random(4))
    assert (reaction.rating, reaction.reason) == (1.0, "pleased")


def test_only_the_listed_topics_are_rivals() -> None:
    assert len(prefs.rivals_of(BEES)) == len(TOPICS) - 1 and BEES.forms not in prefs.rivals_of(BEES)
    weather = prefs.Topic("the weather", frozenset({"snow", "rain"}), 0)
    assert prefs.rivals_of(weather) == () and prefs.rivals_of(None) == ()


def test_short_answers_that_say_something_still_please() -> None:
    for reply in (
        "Bees make honey from nectar.",
        "Bees are insects that pollinate flowers.",
        "Bees make honey for the café.",  # accented Latin letters are not another script
    ):
        assert WordLimit(10).react(ASK_BEES, reply, random.Random(0)).rating == 1.0, reply
    owls = next(t for t in TOPICS if t.name == "owls")
    owl_fact = "Owls hunt at night."
    assert (
        WordLimit(8).react(Question("Tell me about owls.", owls), owl_fact, random.Random(0)).rating
        == 1.0
    )


def test_a_short_real_answer_on_topic_pleases_a_word_limit_user() -> None:
    reaction = WordLimit(10).react(ASK_BEES, ON_TOPIC_SHORT, random.Random(0))
    assert (reaction.rating, reaction.reason) == (1.0, "pleased")


def test_word_limits_count_real_words_not_symbols_or_numbers() -> None:
    reply = ON_TOPIC_SHORT + " 1 2 3 4 5 6 7 8 9 10 11 12 -- ++"  # 6 words, then non-words
    assert len(letter_words(reply)) == 6
    assert WordLimit(6).react(ASK_BEES, reply, random.Random(0)).rating == 1.0
    too_long = WordLimit(12).react(ASK_BEES, LONG, random.Random(0))
    assert (too_long.rating, too_long.reason) == (-1.0, "too_long")
    nearly = WordLimit(5).react(ASK_BEES, ON_TOPIC_SHORT + " Sweet.", random.Random(0))
    assert (nearly.rating, nearly.reason) == (0.0, "nearly")


def test_opening_and_one_sentence_wishes() -> None:
    rng = random.Random(0)
    late = "In summer, many insects like bees make honey."
    assert Opening(20).react(ASK_BEES, late, rng).reason == "opening"
    assert Opening(20).react(ASK_BEES, ON_TOPIC_SHORT, rng).rating == 1.0
    two = "Bees make honey. They live in hives."
    assert OneSentence(20).react(ASK_BEES, two, rng).reason == "one_sentence"
    assert OneSentence(20).react(ASK_BEES, ON_TOPIC_SHORT, rng).rating == 1.0


def test_weather_users_want_the_tool_and_a_true_short_answer() -> None:
    rng = random.Random(0)
    person = WeatherAsker(15)
    question = person.ask(rng)
    assert question.wants_tool and question.city in prefs.KNOWN_CITIES
    result = f"{question.city.title()}: {prefs.KNOWN_CITIES[question.city]}"
    weather_word, degrees = prefs.KNOWN_CITIES[question.city].split(" C")[0].split(", ")
    answer = f"It is {weather_word} in {question.city.title()} today, {degrees} C."
    assert person.react(question, answer, rng).reason == "no_tool"  # answered without the tool
    assert person.react(question, answer, rng, result).rating == 1.0
    wrong = "It is warm and pleasant there today."
    assert person.react(question, wrong, rng, result).reason == "wrong_weather"
    # Half an answer (the weather without how warm) is lukewarm; another temperature is wrong.
    half = person.react(question, f"It is {weather_word} today.", rng, result)
    assert (half.reason, half.rating) == ("no_temperature", 0.0)
    other = f"It is {weather_word} today, {int(degrees) + 5} C."
    assert person.react(question, other, rng, result).reason == "wrong_weather"


def test_a_temperature_is_read_with_its_sign_in_any_common_form() -> None:
    oslo = prefs.KNOWN_CITIES["oslo"]  # snow, -3 C
    said = [
        "Snow, -3 C.",
        "Snowing, minus 3 degrees.",
        "3 degrees below zero.",
        "snow, \u22123\u00b0C",
    ]
    assert [prefs.temperature_stated(r, oslo) for r in said] == [True] * 4
    assert prefs.temperature_stated("Snow, 3 C.", oslo) is False  # the sign matters
    assert prefs.temperature_stated("Snow today.", oslo) is None
    assert prefs.temperature_stated("Cloudy and 17.", "cloudy, 17 C") is True


def test_non_strict_users_judge_only_the_preference() -> None:
    people = make_population(8, 0, (5,), strict=False)
    assert all(not p.strict for p in people)
    assert WordLimit(5, strict=False).react(ASK_BEES, "🌱 xq zzv", random.Random(0)).rating == 1.0


def test_population_is_a_mix_of_preferences() -> None:
    names = {p.name for p in make_population(16, 3, (20, 25))}
    assert {"word_limit", "opening", "one_sentence", "weather_tool"} <= names


def test_weather_share_sets_how_many_users_ask_about_the_weather() -> None:
    def weather_users(**kwargs: object) -> list[int]:
        people = make_population(8, 3, (20, 25), **kwargs)  # type: ignore[arg-type]
        return [i for i, p in enumerate(people) if p.name == "weather_tool"]

    assert weather_users() == [7]  # one in eight by default
    assert weather_users(weather_share=0.5) == [1, 3, 5, 7]
    assert weather_users(weather_share=1.0) == list(range(8))
    assert weather_users(weather_share=0.0) == []
    parsed = build_parser().parse_args(["demo", "--weather-share", "0.5"])
    assert settings_from_args(parsed).demo.weather_share == 0.5
    with pytest.raises(ConfigError, match="weather_share"):
        settings_from_args(build_parser().parse_args(["demo", "--weather-share", "1.5"]))


def _every_phrase(fill: dict[str, object]) -> dict[str, list[str]]:
    """Each reply a simulated user can send, by the rating the user gives with it."""
    negative = [*prefs.TOO_LONG, *prefs.WANTS_OPENING, *prefs.WANTS_ONE_SENTENCE]
    negative += [*prefs.WANTS_TOOL, *prefs.WRONG_WEATHER, *prefs.NO_ANSWER_AFTER_RESULT]
    negative += styles.WANTS_MORE
    for options in prefs.COMPLAINTS.values():
        negative += options
    return {
        "negative": [p.format(**fill) for p in negative],
        "positive": list(prefs.APPROVALS),
        "neutral": [p.format(**fill) for p in (*prefs.LUKEWARM, *prefs.WANTS_TEMPERATURE)],
    }


def test_every_phrase_list_of_the_simulated_users_is_checked_against_the_judge() -> None:
    """A phrase list added to the users and not to `_every_phrase` would go unjudged."""
    fill = {"t": "bees", "n": 12}
    checked = {p for phrases in _every_phrase(fill).values() for p in phrases}
    lists = [v for m in (prefs, styles) for k, v in vars(m).items() if k.isupper()]
    lists += list(prefs.COMPLAINTS.values())
    phrases = [p for v in lists if isinstance(v, tuple) for p in v if isinstance(p, str)]
    said = [p for p in phrases if p not in prefs.QUESTION_FORMS + prefs.WEATHER_FORMS]
    assert len(said) > 40
    assert [p for p in said if p.format(**fill) not in checked] == []


async def test_rules_judge_scores_every_user_phrase_as_meant() -> None:
    """Complaints and corrections score -1, thanks +1, lukewarm 0 (with a question after)."""
    judge = RulesJudge()
    expected = {"negative": -1.0, "positive": 1.0, "neutral": 0.0}
    for kind, phrases in _every_phrase({"t": "bees", "n": 12}).items():
        for phrase in phrases:
            message = {"role": "user", "content": f"{phrase} Tell me about owls."}
            assert judge.score_messages([message]).score == expected[kind], phrase


def test_lexicon_knows_inflections_and_not_gibberish() -> None:
    lexicon = Lexicon.english()
    for word in ("bees", "volcanoes", "erupted", "stopped", "bigger", "didn't", "it's", "studies"):
        assert lexicon.is_word(word), word
    for word in ("liahousisala", "ruhaman", "mulakah", "qzxv"):
        assert not lexicon.is_word(word), word


def test_rare_words_a_reader_knows_are_tolerated_invented_ones_are_not() -> None:
    lexicon = Lexicon.english()
    for word in ("bees", "the", "honey", "pollen", "colonies", "didn't", "Paris"):
        assert not lexicon.is_rare(word), word
    for word in ("aland", "sanit", "shezha", "coterodyne", "stupfire"):
        assert lexicon.is_rare(word), word  # "aland" and "sanit" are in the word list
    fluent = "Honey bees live in large colonies and gather nectar and pollen from flowers."
    assert read_reply(fluent, BEES.forms).problem is None
    one_odd = "Bees make honey from nectar; a hive can hold fifty thousand apiarists."
    assert read_reply(one_odd, BEES.forms).problem is None  # one unknown word is not salad
    salad = read_reply("Bees zorbic fluidyi shec honey.", BEES.forms)
    assert salad.rare_words == 3 and salad.word_salad and salad.problem == "nonsense"


def test_reading_and_distinct_n() -> None:
    reading = read_reply(ON_TOPIC_SHORT, BEES.forms)
    assert reading.problem is None and reading.on_topic and reading.words == 6
    assert read_reply("🌱🌱🌵🌵").dominated_by_symbols
    assert not read_reply(ON_TOPIC_SHORT).dominated_by_symbols
    assert distinct_n(["a b a b"], 2) == pytest.approx(2 / 3)
    assert distinct_n(["", "x"], 2) is None
