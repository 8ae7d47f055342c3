"""How a person reads a reply: real English words, on topic, not symbols, repeats or markup.

The simulated users must not be gameable. Counting words by whitespace made a run of emoji
"one word" and a string of invented syllables a perfectly brief answer; a person would
say "that makes no sense". `read_reply` looks at a reply the way a reader does: which of
its pieces are words of English (an English word list, with regular inflections), how
many are words a reader would not know (rare or invented: "coterodyne", "shezha"), how
much of it is symbols, markup or the same fragment repeated, and whether it is about what
was asked: it names the topic, and no other topic a reader knows the conversation could be
about leads it ("Bees aren't volcanoes, but they're closely related" does not answer a
question about volcanoes). The same reading gives the demo report and the promotion gate
their quality measures.

The rare-word test is what catches word salad. A big word list holds obscure forms
("aland", "sanit") that a policy drifting into nonsense produces, so being in the list is
not enough: a word must also be common in real English text (the `wordfreq` wheel's
frequencies, on the Zipf scale: 3 is once per million words).
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

WORD = re.compile(r"[A-Za-z]+(?:['’][A-Za-z]+)*")
# Characters a plain English answer uses besides letters, digits and whitespace.
PLAIN_PUNCTUATION = frozenset(".,;:!?'\"()-–—%$&/+°’“”…")
MARKUP = re.compile(r"<[^<>\n]{0,80}>|```|\*\*|__|^\s*#+|^\s*\||\[[^\]\n]*\]\([^)\n]*\)", re.M)
CONTRACTIONS = ("n't", "'s", "'re", "'ve", "'ll", "'d", "'m")
# (suffix, replacement) tried in order when a word form is not in the list itself.
INFLECTIONS = (
    ("ies", "y"), ("ied", "y"), ("ves", "f"), ("es", ""), ("s", ""), ("ed", ""), ("ed", "e"),
    ("ing", ""), ("ing", "e"), ("ly", ""), ("er", ""), ("er", "e"), ("est", ""), ("est", "e"),
)  # fmt: skip
DOUBLING = frozenset({"ed", "ing", "er", "est"})
# Thresholds of a sensible reply (what a reader tolerates before calling it nonsense).
MIN_ENGLISH_SHARE = 0.7
RARE_ZIPF = 2.5  # rarer than about 3 in 10 million words of English text: unknown to a reader
MAX_RARE_SHARE = 0.15  # more rare words than this (and at least MIN_RARE_WORDS): nonsense
MIN_RARE_WORDS = 2
MAX_SYMBOL_SHARE = 0.15
MAX_MARKUP_SHARE = 0.3
MAX_REPETITION = 0.3
MIN_CONTENT_WORDS = 3  # distinct content words an answer to "tell me about X" needs at least
# Words that carry no content of their own: function words, and words about the answer
# itself ("30 words.", "Short answer:"), which a policy can echo from a correction.
FUNCTION_WORDS_TEXT = """
    a an the this that these those there here it its it's they them their theirs he him
    his she her hers we us our you your i me my mine who whom whose which what when where why
    how is are was were be been being am do does did done doing have has had having will would
    shall should can could may might must of in on at to for from by with without about as
    into onto over under up down out off than then so such too very also just only not no nor
    yes and or but if because while though although all any some each every both either neither
    more most less least much many few one ones other others another same own like s t don't
    doesn't didn't isn't aren't wasn't weren't can't won't"""
META_WORDS_TEXT = """
    word words sentence sentences answer answers reply replies question questions short
    shorter shortest brief briefly limit sure okay ok thanks thank please hello hi certainly
    well oh yeah fine great here's that's"""
# Words that frame a request rather than name what it is about ("Tell me about bees.").
REQUEST_WORDS_TEXT = """
    tell explain describe give show say talk write list define summarise summarize know
    knowing need want wish think help let get make find mean means fact facts info
    information detail details thing things something anything everything kind people
    person keep try again now right today what's how's who's where's why's i'm you're
    interesting good best"""
FUNCTION_WORDS = frozenset(FUNCTION_WORDS_TEXT.split())
REQUEST_WORDS = frozenset(REQUEST_WORDS_TEXT.split())
SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+")
META_WORDS = frozenset(META_WORDS_TEXT.split())


class Lexicon:
    """A set of English words, how common each is, and the test of whether a form is a word.

    `zipf` gives a form's frequency on the Zipf scale (log10 of uses per billion words);
    without one every listed word counts as common.
    """

    def __init__(self, words: Iterable[str], zipf: Callable[[str], float] | None = None) -> None:
        self.words = frozenset(w.lower() for w in words)
        self.zipf = zipf

    @classmethod
    @functools.cache
    def english(cls) -> Lexicon:
        """The web2 and GCIDE word lists (`english-words`) and English frequencies (`wordfreq`)."""
        from english_words import get_english_words_set
        from wordfreq import zipf_frequency

        words = get_english_words_set(["web2", "gcide"], alpha=True, lower=True)
        return cls(words, functools.partial(zipf_frequency, lang="en"))

    def is_rare(self, form: str) -> bool:
        """True for a form a reader would not know: rare in English text, or invented."""
        if self.zipf is None:
            return not self.is_word(form)
        return self.zipf(form.replace("’", "'")) < RARE_ZIPF

    def is_word(self, form: str) -> bool:
        """True for an English word, its regular inflections and contractions ("bees", "didn't")."""
        form = form.lower().replace("’", "'")
        for ending in CONTRACTIONS:
            if form.endswith(ending) and len(form) > len(ending):
                stem = form[: -len(ending)]
                return stem in {"ca", "wo", "sha"} or self.is_word(stem)
        if form in self.words:
            return True
        for suffix, replacement in INFLECTIONS:
            if form.endswith(suffix) and len(form) - len(suffix) >= 2:
                stem = form[: -len(suffix)] + replacement
                doubled = suffix in DOUBLING and len(stem) > 2 and stem[-1] == stem[-2]
                if stem in self.words or (doubled and stem[:-1] in self.words):
                    return True  # "bees", "erupted"; doubled consonant: "stopped", "bigger"
        return False


def letter_words(text: str | None) -> list[str]:
    """The words of a text as a reader counts them: runs of letters, not symbols or numbers."""
    return WORD.findall(text or "")


def foreign_letters(text: str | None) -> int:
    """How many letters are of another script than the Latin one: a reader of English cannot
    read a reply that slides into Chinese or Cyrillic, even for one word ("21摄氏度")."""
    return sum(
        1
        for c in text or ""
        if c.isalpha() and not c.isascii() and not unicodedata.name(c, "").startswith("LATIN")
    )


def symbol_share(text: str | None) -> float:
    """Share of the non-space characters that are neither letters, digits nor punctuation."""
    chars = [c for c in (text or "") if not c.isspace()]
    if not chars:
        return 0.0
    odd = sum(1 for c in chars if not (c.isascii() and c.isalnum()) and c not in PLAIN_PUNCTUATION)
    return odd / len(chars)


def markup_share(text: str | None) -> float:
    """Share of the non-space characters inside markup (tags, fences, bold, headings, links)."""
    text = text or ""
    total = sum(1 for c in text if not c.isspace())
    if not total:
        return 0.0
    marked = sum(len(m.group(0).strip()) for m in MARKUP.finditer(text))
    return min(1.0, marked / total)


def repetition(words: list[str]) -> float:
    """How much of a reply repeats itself: repeated word 3-grams, or one word dominating."""
    lowered = [w.lower() for w in words]
    if len(lowered) >= 4:
        top = Counter(lowered).most_common(1)[0][1]
        if top / len(lowered) > 0.5:
            return top / len(lowered)
    grams = list(zip(lowered, lowered[1:], lowered[2:], strict=False))
    if len(grams) < 3:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def distinct_n(texts: Iterable[str], n: int = 2) -> float | None:
    """Distinct word n-grams over all n-grams of the texts (None when there are none)."""
    grams: list[tuple[str, ...]] = []
    for text in texts:
        words = [w.lower() for w in letter_words(text)]
        grams += [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None


@dataclass(frozen=True)
class ReplyReading:
    """What a reader notices about one reply."""

    words: int  # letter words (what a word limit counts)
    english_share: float  # share of those that are English words
    rare_words: int  # words a reader would not know (rare or invented), topic words aside
    symbol_share: float
    markup_share: float
    repetition: float
    on_topic: bool | None  # names the topic, no rival leads it; None when no topic was given
    thin: bool = False  # on topic but says nothing about it ("Bread.  30 words.")
    foreign_letters: int = 0  # letters of another script than the Latin one ("21摄氏度")

    @property
    def problem(self) -> str | None:
        """Why a reader would not accept the reply as an answer at all, or None."""
        if self.markup_share > MAX_MARKUP_SHARE:
            return "markup"
        if self.foreign_letters:
            return "foreign"
        if self.symbol_share > MAX_SYMBOL_SHARE:
            return "symbols"
        if self.words == 0 or self.english_share < MIN_ENGLISH_SHARE or self.word_salad:
            return "nonsense"
        if self.repetition > MAX_REPETITION:
            return "repetitive"
        if self.on_topic is False:
            return "off_topic"
        if self.thin:
            return "thin"
        return None

    @property
    def no_answer(self) -> bool:
        """Not an answer at all (nonsense, word salad, another script, symbols, markup,
        repeats); off-topic and thin replies are answers, to the wrong question or with too
        little in them."""
        return self.problem not in (None, "off_topic", "thin")

    @property
    def rare_share(self) -> float:
        """Share of the words a reader would not know."""
        return self.rare_words / self.words if self.words else 0.0

    @property
    def word_salad(self) -> bool:
        """Too many unknown words to read as an answer ("a massive coterodyne: snusloliasi")."""
        return self.rare_words >= MIN_RARE_WORDS and self.rare_share > MAX_RARE_SHARE

    @property
    def dominated_by_symbols(self) -> bool:
        """Mostly emoji, symbols or markup: no reader would call this text."""
        return (
            self.symbol_share > 0.5
            or self.markup_share > 0.5
            or (self.words == 0 and self.symbol_share > 0)
        )


def is_form(word: str, forms: frozenset[str]) -> bool:
    """True when `word` (case-insensitive, a possessive ending aside) is one of `forms`:
    "river's" and "rivers'" name rivers."""
    w = word.lower().replace("’", "'")
    return w in forms or (w.endswith("'s") and w[:-2] in forms) or w.rstrip("'") in forms


def mentions(words: list[str], forms: frozenset[str]) -> bool:
    """True when any word is one of `forms` (`is_form`)."""
    return any(is_form(w, forms) for w in words)


def _count_and_first(words: list[str], forms: frozenset[str]) -> tuple[int, int]:
    """How many of `words` are one of `forms`, and the position of the first (len if none)."""
    hits = [i for i, w in enumerate(words) if is_form(w, forms)]
    return len(hits), hits[0] if hits else len(words)


def led_by_rival(
    words: list[str], topic_forms: frozenset[str], rivals: Iterable[frozenset[str]]
) -> bool:
    """True when another topic leads the reply: one of `rivals` is named more often than the
    topic asked about, or as often and before it. Forms the two topics share ("brew" for tea
    and coffee) count for the topic asked."""
    count, first = _count_and_first(words, topic_forms)
    for rival in rivals:
        other, other_first = _count_and_first(words, rival - topic_forms)
        if other and (other > count or (other == count and other_first < first)):
            return True
    return False


def content_words(words: list[str]) -> set[str]:
    """The distinct words that say something: neither function words nor words about the
    answer itself ("words", "sentence", "sure")."""
    lowered = {w.lower().replace("’", "'") for w in words}
    return {w for w in lowered if w not in FUNCTION_WORDS and w not in META_WORDS}


def word_forms(word: str) -> set[str]:
    """`word` (lower case) with its plural or singular and possessive ("bee": "bees",
    "bee's"; "glaciers": "glacier"; "berry": "berries"), for matching a reply's words. Where
    spelling alone cannot tell, both candidates are kept ("shoes": "shoe" and "sho";
    "potato": "potatoes" and "potatos"): a form no reply uses matches nothing."""
    w = word.lower()
    forms = {w}
    if w.endswith("ies") and len(w) > 4:
        forms.add(w[:-3] + "y")
    elif w.endswith(("ches", "shes", "xes", "oes")):
        forms |= {w[:-2], w[:-1]}
    elif w.endswith("sses"):
        forms.add(w[:-2])
    elif w.endswith("s") and not w.endswith("ss"):
        forms.add(w[:-1])
    elif w.endswith("y") and len(w) > 2 and w[-2] not in "aeiou":
        forms.add(w[:-1] + "ies")
    elif w.endswith("o"):
        forms |= {w + "es", w + "s"}
    elif w.endswith(("ch", "sh", "x", "ss")):
        forms.add(w + "es")
    else:
        forms.add(w + "s")
    return forms | {f + "'s" for f in forms if not f.endswith("s")}


def question_topic(text: str | None) -> frozenset[str] | None:
    """What a request is about, as word forms a reply on topic would use: the content words
    of its last sentence that has any, request framing ("tell me", "explain") and the
    function words aside. "That's too long. Tell me about glaciers." is about glaciers.
    None when no sentence names anything ("Why?")."""
    for sentence in reversed(SENTENCE_BREAK.split(text or "")):
        named = content_words(letter_words(sentence)) - REQUEST_WORDS
        if named:
            return frozenset(form for w in named for form in word_forms(w))
    return None


def says_too_little(
    words: list[str], topic_forms: frozenset[str], min_content: int, lexicon: Lexicon
) -> bool:
    """True when an answer names the topic but says nothing about it: fewer than
    `min_content` known content words, or none beyond the topic's own words. Invented or
    rare words say nothing to a reader ("The moon is like meetitoun.")."""
    if min_content <= 0:
        return False
    content = {w for w in content_words(words) if w in topic_forms or not lexicon.is_rare(w)}
    return len(content) < min_content or not content - topic_forms


def read_reply(
    text: str | None,
    topic_forms: frozenset[str] | None = None,
    lexicon: Lexicon | None = None,
    min_content: int = MIN_CONTENT_WORDS,
    rivals: Iterable[frozenset[str]] = (),
) -> ReplyReading:
    """Read one reply; `topic_forms` are the words that show it is about what was asked, and
    an answer about a topic needs `min_content` content words (0: any answer will do).
    `rivals` are the forms of other topics the reader knows of: a reply that one of them
    leads (`led_by_rival`) is off topic even though it names the topic asked."""
    lexicon = lexicon or Lexicon.english()
    words = letter_words(text)
    english = sum(1 for w in words if lexicon.is_word(w))
    known = topic_forms or frozenset()
    rare = sum(1 for w in words if w.lower() not in known and lexicon.is_rare(w))
    on_topic = None
    if topic_forms is not None:
        on_topic = mentions(words, topic_forms) and not led_by_rival(words, topic_forms, rivals)
    return ReplyReading(
        words=len(words),
        english_share=english / len(words) if words else 0.0,
        rare_words=rare,
        symbol_share=symbol_share(text),
        markup_share=markup_share(text),
        repetition=repetition(words),
        on_topic=on_topic,
        thin=bool(on_topic) and says_too_little(words, known, min_content, lexicon),
        foreign_letters=foreign_letters(text),
    )
