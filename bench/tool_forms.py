"""What an instruct model writes when its chat template offers tools: the forms, counted.

Renders each question with one to three offered tools through the server's own chat
template code (the exact prompt `liveloop serve` builds), samples several replies per prompt
with one batched `generate` call (fixed seed per prompt), and sorts every reply into one
form: `tagged` (a `<tool_call>` block), `fenced` (a ``` fence holding a JSON object or list
of objects with a "name"), `bare` (such JSON outside a fence, starting a line),
`bare_unclosed` (such JSON that ends without its last closing brackets), `name_tags`
(`<name>function</name>` then `<arguments>{...}</arguments>`), `tools_echo` (the
prompt's `<tools>` listing written back) or `text` (none of these). For each reply it also records whether the server's parser
(`liveloop.server.tools.parse_tool_calls`, told which tools were offered) turns it into a
tool call. Questions are of three kinds: `tool` (one offered tool answers it), `no_tool`
(none does) and `chat` (no tool needed at all). Prints one JSON object; `--samples-out`
writes every reply as well.

    python bench/tool_forms.py [--model qwen2.5-coder-0.5b] [--per-prompt 10] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.model_sampling import sample_completions  # noqa: E402
from liveloop.models import load_model  # noqa: E402
from liveloop.server.tools import parse_tool_calls  # noqa: E402
from liveloop.server.tools.call_json import closed_json  # noqa: E402
from liveloop.server.tools.spec import parse_tools  # noqa: E402
from liveloop.server.tools.template import ChatTemplate  # noqa: E402


def _tool(name: str, description: str, **properties: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {
                    k: {"type": "string", "description": v} for k, v in properties.items()
                },
                "required": list(properties),
            },
        },
    }


WEATHER = _tool("get_weather", "Current weather for a city.", city="City name, e.g. Oslo")
TIME = _tool(
    "get_time", "Current local time in a timezone.", timezone="IANA name, e.g. Europe/Oslo"
)
SEARCH = _tool("search_web", "Search the web and return the top results.", query="Search terms")
CURRENCY = _tool(
    "convert_currency",
    "Convert an amount of money between currencies.",
    amount="Amount as a decimal string",
    source="ISO code to convert from",
    target="ISO code to convert to",
)
SHELL = _tool("run_shell", "Run a shell command and return its output.", command="The command")

# (question, kind, offered tools)
PROMPTS: list[tuple[str, str, list[dict[str, Any]]]] = [
    ("What's the weather in Oslo?", "tool", [WEATHER]),
    ("Is it raining in Paris right now?", "tool", [WEATHER]),
    ("Do I need an umbrella in London today?", "tool", [WEATHER, TIME]),
    ("How warm is it in Tokyo?", "tool", [SEARCH, WEATHER, TIME]),
    ("What time is it in New York?", "tool", [WEATHER, TIME]),
    ("Tell me the current time in Sydney.", "tool", [TIME]),
    ("Convert 100 euros to US dollars.", "tool", [CURRENCY, WEATHER]),
    ("Who won the football world cup in 2022? Look it up.", "tool", [SEARCH]),
    ("List the files in the current directory.", "tool", [SHELL, SEARCH]),
    ("What's the weather like in Berlin and in Rome?", "tool", [WEATHER]),
    ("Find recent news about the James Webb telescope.", "tool", [SEARCH, TIME, WEATHER]),
    ("How much is 50 GBP in JPY?", "tool", [CURRENCY]),
    ("Write a Python function that reverses a string.", "chat", [WEATHER]),
    ("What is 17 times 23?", "chat", [WEATHER, TIME]),
    ("Say hello in French.", "chat", [SEARCH]),
    ("Explain what a linked list is in two sentences.", "chat", [SHELL, CURRENCY, TIME]),
    ("Thanks, that's all!", "chat", [WEATHER]),
    ("What's the capital of Australia?", "chat", [CURRENCY]),
    ("Book me a table for two at an Italian restaurant.", "no_tool", [WEATHER, TIME]),
    ("Send an email to my boss saying I'm late.", "no_tool", [SEARCH]),
    ("Translate 'good morning' into German.", "chat", [WEATHER, SEARCH]),
    ("Write a haiku about autumn.", "chat", [TIME]),
    ("What is the weather going to be in Madrid tomorrow?", "tool", [WEATHER, CURRENCY]),
    ("Check the weather in Reykjavik for me, please.", "tool", [TIME, WEATHER]),
    ("What day of the week is it in Los Angeles?", "tool", [TIME, SEARCH]),
]

FENCE = re.compile(r"```[A-Za-z]*[ \t]*\n(.*?)```", re.DOTALL)
LINE_START_JSON = re.compile(r"(?m)^[ \t]*([{\[])")
NAME_TAGS = re.compile(
    r"<name>\s*([A-Za-z0-9_-]+)\s*</name>\s*<arguments>(.*?)(?:</arguments>|\Z)", re.DOTALL
)


def _names(value: Any) -> list[str] | None:
    """Function names of a JSON call object (or list of them), None if it is not one."""
    items = value if isinstance(value, list) else [value]
    names = [i.get("name") for i in items if isinstance(i, dict)]
    if not names or len(names) != len(items) or not all(isinstance(n, str) for n in names):
        return None
    return [str(n) for n in names]


def _first_json(text: str) -> Any:
    decoder = json.JSONDecoder()
    for match in LINE_START_JSON.finditer(text):
        try:
            value, _ = decoder.raw_decode(text, match.start(1))
        except ValueError:
            continue
        if _names(value) is not None:
            return value
    return None


def _unclosed_json(text: str) -> Any:
    """The call JSON of a reply that ends without its last closing brackets."""
    for match in LINE_START_JSON.finditer(text):
        closed = closed_json(text[match.start(1) :])
        try:
            value = json.loads(closed) if closed is not None else None
        except ValueError:
            continue
        if _names(value) is not None:
            return value
    return None


def classify(text: str) -> tuple[str, Any]:
    """The reply's form and the JSON it holds (None for `tagged`, `tools_echo` and `text`)."""
    if "<tool_call>" in text:
        return "tagged", None
    for match in FENCE.finditer(text + ("```" if text.count("```") % 2 else "")):
        value = _first_json(match.group(1))
        if value is not None:
            return "fenced", value
    value = _first_json(text)
    if value is not None:
        return "bare", value
    value = _unclosed_json(text)
    if value is not None:
        return "bare_unclosed", value
    tags = NAME_TAGS.search(text)
    if tags is not None:
        try:
            arguments = json.loads(tags.group(2))
        except ValueError:
            arguments = None
        return "name_tags", {"name": tags.group(1), "arguments": arguments}
    if "<tools>" in text:
        return "tools_echo", None
    return "text", None


def _detail(text: str, value: Any, offered: set[str]) -> dict[str, Any]:
    items = value if isinstance(value, list) else [value]
    keys = sorted({k for i in items for k in i if k != "name"})
    names = _names(value) or []
    return {
        "list": isinstance(value, list),
        "argument_keys": keys,
        "names_offered": all(n in offered for n in names),
        "alone": text.strip().startswith(("{", "[", "```")),
    }


def generate(lm: Any, template: ChatTemplate, args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    rows: list[dict[str, Any]] = []
    for p, (question, kind, tools) in enumerate(PROMPTS):
        ids = template.render_ids([{"role": "user", "content": question}], tools)
        torch.manual_seed(args.seed + p)
        start = time.perf_counter()
        completions = sample_completions(
            lm, ids, args.per_prompt, args.max_tokens, args.temperature
        )
        seconds = time.perf_counter() - start
        for completion in completions:
            rows.append(
                {
                    "prompt": p,
                    "kind": kind,
                    "question": question,
                    "tools": [t["function"]["name"] for t in tools],
                    "text": completion.text,
                    "tokens": completion.tokens,
                    "truncated": not completion.ended,
                }
            )
        print(f"prompt {p}: {seconds:.1f} s", file=sys.stderr, flush=True)
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    tools_by_name = {t["function"]["name"]: t for _q, _k, ts in PROMPTS for t in ts}
    forms: Counter[str] = Counter()
    by_kind: dict[str, Counter[str]] = {}
    parsed: Counter[str] = Counter()
    details: Counter[str] = Counter()
    calls_by_kind: dict[str, Counter[str]] = {}
    for row in rows:
        form, value = classify(row["text"])
        row["form"] = form
        forms[form] += 1
        by_kind.setdefault(row["kind"], Counter())[form] += 1
        offered = [tools_by_name[n] for n in row["tools"]]
        _content, calls = parse_tool_calls(
            row["text"], truncated=row["truncated"], tools=parse_tools(offered)
        )
        row["parsed_calls"] = [c["function"] for c in calls]
        parsed[f"{form}:{'call' if calls else 'no_call'}"] += 1
        kind = calls_by_kind.setdefault(row["kind"], Counter())
        kind["samples"] += 1
        kind["calls_read"] += bool(calls)
        kind["calls_read_tags_only"] += bool(parse_tool_calls(row["text"], row["truncated"])[1])
        if value is not None:
            d = _detail(row["text"], value, set(row["tools"]))
            details[f"{form}:list={d['list']}"] += 1
            details[f"{form}:keys={','.join(d['argument_keys'])}"] += 1
            details[f"{form}:names_offered={d['names_offered']}"] += 1
            details[f"{form}:alone={d['alone']}"] += 1
    return {
        "samples": len(rows),
        "forms": dict(forms),
        "forms_by_question_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "server_parser": dict(sorted(parsed.items())),
        # replies with a call, read with the offered tools and with tags only (the old parser)
        "calls_by_question_kind": {k: dict(v) for k, v in sorted(calls_by_kind.items())},
        "json_details": dict(sorted(details.items())),
        "truncated": sum(r["truncated"] for r in rows),
        "mean_tokens": round(sum(r["tokens"] for r in rows) / max(1, len(rows)), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--per-prompt", type=int, default=10, help="samples per prompt")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (shared machine)")
    parser.add_argument("--samples-out", type=Path, help="write every reply here (JSON)")
    parser.add_argument(
        "--from-samples", type=Path, help="count the replies of an earlier --samples-out"
    )
    args = parser.parse_args()

    start = time.perf_counter()
    if args.from_samples:
        rows = json.loads(args.from_samples.read_text())
    else:
        import torch

        torch.set_num_threads(args.threads)
        lm = load_model(args.model)
        rows = generate(lm, ChatTemplate(lm.tokenizer), args)
        if args.samples_out:
            args.samples_out.write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n")
    result = {
        "model": args.model,
        "per_prompt": args.per_prompt,
        "prompts": len(PROMPTS),
        "temperature": args.temperature,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "threads": args.threads,
        "seconds": round(time.perf_counter() - start, 1),
        **summarize(rows),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
