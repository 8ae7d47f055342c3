"""What a complaint that names the last topic does to the answer to the next question.

The demo's users send their reaction to a reply and their next question in one message
("Please stay on topic, I asked about rivers. What should I know about chess?"), and the
reply to it is judged against the new question. This measures what naming the earlier topic
costs, on one model with the demo's sampling: for pairs of topics (X asked first, Y next) one
conversation (the question on X, the model's own greedy reply to it) ends in three user
messages, each asking the same question on Y:

- `question`: the question on Y alone;
- `previous`: a complaint naming X, then the question (the message the demo's users send);
- `asked`: the same complaint naming Y, then the question.

The complaints are those of the demo's users that name a topic (off topic, thin answer, the
explained tenant's "start with" and "tell me more"). Each sampled reply is read by a user of
each conflicting house style as the demo reads it (the rating and its reason), and by whether
its first three words name Y or X. Prints one JSON object.

    python bench/complaint_prompts.py [--model smollm2-135m] [--pairs 16] [--per-prompt 8]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.learning_summary import spread  # noqa: E402
from bench.model_sampling import sample_completions  # noqa: E402
from liveloop.config.defaults import model_defaults  # noqa: E402
from liveloop.demo.preferences import (  # noqa: E402
    COMPLAINTS,
    QUESTION_FORMS,
    TOPICS,
    WANTS_OPENING,
    Question,
    Topic,
    WordLimit,
)
from liveloop.demo.styles import WANTS_MORE, Explained  # noqa: E402
from liveloop.reading import letter_words, mentions  # noqa: E402

ARMS = ("question", "previous", "asked")
# The users' complaints that name the topic they asked about.
NAMING = tuple(
    c
    for c in (*COMPLAINTS["off_topic"], *COMPLAINTS["thin"], *WANTS_OPENING, *WANTS_MORE)
    if "{t}" in c
)


@dataclass(frozen=True)
class Pair:
    """One conversation: `first` asked and answered, then a message asking `then`."""

    first: Question
    then: Question
    complaint: str  # a template with {t}

    def message(self, arm: str) -> str:
        """The user's second message in `arm`."""
        assert self.first.topic is not None and self.then.topic is not None
        if arm == "question":
            return self.then.text
        named = self.first.topic if arm == "previous" else self.then.topic
        return f"{self.complaint.format(t=named.name)} {self.then.text}"


def make_pairs(count: int, seed: int) -> list[Pair]:
    """`count` pairs of distinct topics, each with a question form and a naming complaint."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        x, y = rng.sample(TOPICS, 2)
        pairs.append(Pair(_question(rng, x), _question(rng, y), rng.choice(NAMING)))
    return pairs


def _question(rng: random.Random, topic: Topic) -> Question:
    return Question(rng.choice(QUESTION_FORMS).format(t=topic.name), topic=topic)


def rate_reply(pair: Pair, reply: str, brief_words: int, seed: int) -> dict[str, Any]:
    """How the demo's brief and explained users rate `reply` to `pair.then`, and whether
    it opens by naming the topic asked or the one before."""
    assert pair.first.topic is not None and pair.then.topic is not None
    opening = letter_words(reply)[:3]
    read: dict[str, Any] = {
        "opens_asked": mentions(opening, pair.then.topic.forms),
        "opens_previous": mentions(opening, pair.first.topic.forms),
    }
    styles: tuple[WordLimit, ...] = (WordLimit(brief_words, name="brief"), Explained())
    for style in styles:
        reaction = style.react(pair.then, reply, random.Random(seed))
        read[style.name] = {"rating": reaction.rating, "reason": reaction.reason}
    return read


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: the replies, each style's mean rating and reasons, the opening shares."""
    out: dict[str, Any] = {}
    for arm in ARMS:
        mine = [r for r in rows if r["arm"] == arm]
        if not mine:
            continue
        figures: dict[str, Any] = {
            "replies": len(mine),
            "opens_asked": _share(r["opens_asked"] for r in mine),
            "opens_previous": _share(r["opens_previous"] for r in mine),
        }
        for style in ("brief", "explained"):
            ratings = spread([r[style]["rating"] for r in mine])
            reasons = Counter(r[style]["reason"] for r in mine)
            figures[style] = {
                "mean_rating": round(ratings["mean"], 3),
                "rating_se": round(ratings["mean_se"], 3) if ratings["n"] > 1 else None,
                "reasons": {k: round(v / len(mine), 3) for k, v in reasons.most_common()},
            }
        out[arm] = figures
    return out


def _share(flags: Any) -> float:
    values = list(flags)
    return round(sum(values) / len(values), 3) if values else 0.0


def generate(lm: Any, pairs: list[Pair], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every pair's first reply (greedy), then `per_prompt` samples in each arm."""
    import torch

    from liveloop.server.tools.template import ChatTemplate

    template = ChatTemplate(lm.tokenizer)
    max_tokens = args.max_tokens or model_defaults(args.model).reply_tokens
    rows: list[dict[str, Any]] = []
    for p, pair in enumerate(pairs):
        history = [{"role": "user", "content": pair.first.text}]
        ids = template.render_ids(history, None)
        first = sample_completions(lm, ids, 1, max_tokens, None)[0].text
        history.append({"role": "assistant", "content": first})
        for a, arm in enumerate(ARMS):
            messages = [*history, {"role": "user", "content": pair.message(arm)}]
            torch.manual_seed(args.seed + p)  # the same draws in every arm
            ids = template.render_ids(messages, None)
            replies = sample_completions(lm, ids, args.per_prompt, max_tokens, 1.0)
            for s, reply in enumerate(r.text for r in replies):
                read = rate_reply(pair, reply, args.brief_words, args.seed + 1000 * p + 10 * s + a)
                rows.append({"pair": p, "arm": arm, "message": messages[-1]["content"],
                             "reply": reply, **read})  # fmt: skip
        print(f"pair {p}: {pair.first.text!r} -> {pair.then.text!r}", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--pairs", type=int, default=16, help="conversations (topic pairs)")
    parser.add_argument("--per-prompt", type=int, default=8, help="samples per arm and pair")
    parser.add_argument("--max-tokens", type=int, default=None, help="default: the demo's")
    parser.add_argument("--brief-words", type=int, default=20, help="the brief users' limit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--samples-out", type=Path, help="write every reply here (JSON)")
    args = parser.parse_args()

    import torch

    from liveloop.models import load_model

    start = time.perf_counter()
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    rows = generate(lm, make_pairs(args.pairs, args.seed), args)
    if args.samples_out:
        args.samples_out.write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n")
    result = {
        "benchmark": "complaint_prompts",
        "model": args.model,
        "pairs": args.pairs,
        "per_prompt": args.per_prompt,
        "max_tokens": args.max_tokens or model_defaults(args.model).reply_tokens,
        "temperature": 1.0,
        "seed": args.seed,
        "seconds": round(time.perf_counter() - start, 1),
        "arms": summarize(rows),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
