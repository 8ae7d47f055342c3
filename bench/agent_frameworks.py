"""Agent frameworks, unmodified, run a tool-using agent against `liveloop up`.

Why: agents reach LiveLoop through their frameworks, not through hand-written requests, so
a served tool call must be one that the OpenAI Agents SDK and LangChain act on. This starts
`liveloop up --model <model>` (all four loops, its own embedded Valkey and data dir), then
gives each framework an agent with one weather tool that returns a fixed, made-up forecast,
and asks it about the weather in a city. For each framework it prints whether the tool ran
(and with which city), the final answer, whether the answer uses the forecast (it holds the
made-up temperature), the seconds it took, and how the server recorded the run: its turns
in `liveloop:turns` and how many sessions they fell into (one: the tool result was linked
to the call it answers, so the judge sees it as that turn's next state).
Needs the `agents` extra: `pip install -e '.[agents]'`.

    python bench/agent_frameworks.py [--model qwen2.5-coder-0.5b] [--max-tokens 96] [--runs 3]
        [--tool-result-reminder '']    # '' serves without the model's reminder, to compare

(Not `bench/agents.py`: run as a script, that name would shadow the Agents SDK's `agents`.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import redis

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from liveloop.config import SharedSettings  # noqa: E402
from liveloop.valkey import EmbeddedValkey, free_port  # noqa: E402

API_KEY = "sk-bench-agents"
CITY = "Oslo"
QUESTION = f"What's the weather in {CITY} right now?"
TEMPERATURE_C = 17  # the made-up forecast's temperature: the final answer must carry it
INSTRUCTIONS = "You are a helpful assistant. Use the tools you are given to answer."


def forecast(city: str) -> str:
    """The fixed, made-up forecast every tool returns."""
    return f"{city}: {TEMPERATURE_C} degrees Celsius, light rain, wind 4 m/s from the west."


def recorded_turns(redis_url: str, after: str) -> tuple[str, dict[str, Any]]:
    """Turns recorded since stream id `after`: the last id, and their count and sessions."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    entries: Any = client.xrange("liveloop:turns", min=f"({after}" if after != "0" else "-")
    client.close()
    turns = [json.loads(fields["data"]) for _id, fields in entries]
    summary = {
        "turns": len(turns),
        "sessions": len({t["session_id"] for t in turns}),
        "finish_reasons": [t["finish_reason"] for t in turns],
        "replies": [_reply_text(t["response"]) for t in turns],
        "prompt_modes": [t.get("prompt_mode") for t in turns],
    }
    return (entries[-1][0] if entries else after), summary


def _reply_text(response: dict[str, Any]) -> str:
    """A recorded reply in short: its content, then its calls as name(arguments)."""
    calls = [
        f"{c['function']['name']}({' '.join(c['function']['arguments'].split())})"
        for c in response.get("tool_calls") or []
    ]
    return " ".join([response.get("content") or "", *calls]).strip()


def _result(ran: list[str], answer: str, started: float, **extra: Any) -> dict[str, Any]:
    return {
        "tool_ran": bool(ran),
        "tool_cities": ran,
        "final_answer": answer,
        "answer_uses_forecast": str(TEMPERATURE_C) in answer,
        "seconds": round(time.perf_counter() - started, 1),
        **extra,
    }


async def run_openai_agents(
    base_url: str, model: str, max_tokens: int, ran: list[str]
) -> dict[str, Any]:
    """The OpenAI Agents SDK over the chat completions API (each tool run appends to `ran`)."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # tracing uploads to OpenAI, which is not the server here

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather for a city.

        Args:
            city: The city's name, e.g. Paris.
        """
        ran.append(city)
        return forecast(city)

    client = AsyncOpenAI(base_url=base_url + "/v1", api_key=API_KEY, timeout=900)
    agent = Agent(
        name="weather",
        instructions=INSTRUCTIONS,
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(model=model, openai_client=client),
        model_settings=ModelSettings(temperature=0, max_tokens=max_tokens),
    )
    started = time.perf_counter()
    result = await Runner.run(agent, QUESTION, max_turns=4)
    await client.close()
    return _result(ran, str(result.final_output), started, model_calls=len(result.raw_responses))


def run_langchain(base_url: str, model: str, max_tokens: int, ran: list[str]) -> dict[str, Any]:
    """LangChain's agent (`create_agent`) over `langchain-openai`'s ChatOpenAI."""
    from langchain.agents import create_agent
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Current weather for a city (its name, e.g. Paris)."""
        ran.append(city)
        return forecast(city)

    llm = ChatOpenAI(
        model=model,
        base_url=base_url + "/v1",
        api_key=API_KEY,
        temperature=0,
        max_completion_tokens=max_tokens,
        timeout=900,
    )
    agent = create_agent(llm, tools=[get_weather], system_prompt=INSTRUCTIONS)
    started = time.perf_counter()
    state = agent.invoke(
        {"messages": [{"role": "user", "content": QUESTION}]}, {"recursion_limit": 8}
    )
    messages = state["messages"]
    calls = sum(len(getattr(m, "tool_calls", None) or []) for m in messages)
    return _result(ran, str(messages[-1].content), started, tool_calls_in_history=calls)


@contextlib.contextmanager
def liveloop_up(model: str, root: Path, redis_url: str, reminder: str | None) -> Iterator[str]:
    """`liveloop up` on a free port and the given Valkey; the base URL while it runs."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVELOOP_")}
    env.update({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "LIVELOOP_API_KEYS": API_KEY})
    if reminder is not None:
        env["LIVELOOP_TOOL_RESULT_REMINDER"] = reminder
    argv = [sys.executable, "-m", "liveloop.cli", "up", "--model", model, "--quiet"]
    argv += ["--data-dir", str(root / "data"), "--port", str(port), "--log-level", "WARNING"]
    argv += ["--redis-url", redis_url]
    with open(root / "up.log", "wb") as log:
        proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"liveloop up exited: {(root / 'up.log').read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base_url + "/readyz", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        else:
            raise RuntimeError("liveloop up not ready in 900 s")
        yield base_url
    finally:
        proc.terminate()  # SIGTERM: a background shell may have set SIGINT to be ignored
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("openai", "openai-agents", "langchain", "langchain-core", "langchain-openai"):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found


def run_all(base_url: str, redis_url: str | None, args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, Callable[[list[str]], dict[str, Any]]] = {
        "openai-agents": lambda ran: asyncio.run(
            run_openai_agents(base_url, args.model, args.max_tokens, ran)
        ),
        "langchain": lambda ran: run_langchain(base_url, args.model, args.max_tokens, ran),
    }
    results: dict[str, Any] = {}
    last = "0"
    for name, run in runs.items():
        done: list[dict[str, Any]] = []
        for _ in range(args.runs):
            ran: list[str] = []
            started = time.perf_counter()
            try:
                done.append(run(ran))
            except Exception as exc:  # a framework's failure is a result, not a crash
                error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                done.append(_result(ran, "", started, error=error))
            if redis_url:
                time.sleep(2.0)  # the trace writer's last records
                last, done[-1]["recorded"] = recorded_turns(redis_url, last)
        results[name] = {
            "tool_ran": f"{sum(r['tool_ran'] for r in done)}/{len(done)}",
            "answer_uses_forecast": f"{sum(r['answer_uses_forecast'] for r in done)}/{len(done)}",
            "runs": done,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--max-tokens", type=int, default=96, help="per model call")
    parser.add_argument("--base-url", help="a LiveLoop server already running (no `up`)")
    parser.add_argument("--redis-url", help="that server's Redis (to count its turns)")
    parser.add_argument("--runs", type=int, default=1, help="agent runs per framework")
    parser.add_argument(
        "--tool-result-reminder",
        help="the server's `tool_result_reminder` ('' = none; default: the model's)",
    )
    args = parser.parse_args()
    started = time.perf_counter()
    if args.base_url:
        frameworks = run_all(args.base_url, args.redis_url, args)
    else:
        with tempfile.TemporaryDirectory(prefix="liveloop-agents-") as tmp:
            valkey = EmbeddedValkey(Path(tmp) / "valkey", port=free_port()).start()
            try:
                reminder = args.tool_result_reminder
                with liveloop_up(args.model, Path(tmp), valkey.url, reminder) as base_url:
                    ready_s = round(time.perf_counter() - started, 1)
                    frameworks = run_all(base_url, valkey.url, args)
            finally:
                valkey.stop()
    out = {
        "model": args.model,
        "server": "existing" if args.base_url else "liveloop up",
        "question": QUESTION,
        "forecast": forecast(CITY),
        "max_tokens": args.max_tokens,
        "tool_result_reminder": None
        if args.base_url
        else SharedSettings(
            model=args.model, tool_result_reminder=args.tool_result_reminder
        ).effective_tool_result_reminder,
        "server_ready_s": None if args.base_url else ready_s,
        "frameworks": frameworks,
        "versions": _versions(),
    }
    print(json.dumps(out, indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
