"""Benchmark of the SGLang gateway: what it costs, and what a rolling update costs.

Why: with `server.engine = "sglang"` every token passes through LiveLoop's server. This
measures, in one run and side by side:

1. time to first token and tokens/s through the gateway (`/v1/chat/completions`,
   streamed) vs the same prompt ids sent to SGLang's `/generate` directly, at 1 and at
   8 concurrent streams;
2. the largest gap between two tokens of the streams in flight while a new checkpoint
   rolls across 2 replicas (`POST /admin/weights`), vs the same streams without update.

SGLang servers: `--sglang-url URL,URL` (running ones) or `--launch 2` (started here with
the gateway's own launcher; `--device` is `cuda` unless told otherwise, so the script
runs unchanged on a GPU machine). On a CPU machine SGLang needs CPU kernels:
`--device cpu --python .venv-sglang/bin/python --launch-env PYTHONPATH=tests/support/
sgl_kernel_cpu_shim` (what `make test-sglang` uses). Prints one JSON object.

    python bench/sglang.py --launch 2 --device cpu --python .venv-sglang/bin/python \\
        --launch-env PYTHONPATH=tests/support/sgl_kernel_cpu_shim --max-tokens 32 \\
        --launch-arg=--max-total-tokens --launch-arg=32768 \\
        --launch-arg=--max-running-requests --launch-arg=16

(On CPU, without a token budget each SGLang scheduler sizes its KV cache to about 11 GB, and
two of them do not fit in 24 GB: the OOM killer ends one. The budget is what
`make test-sglang` gives its servers too.)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from liveloop.config import SGLangConfig
from liveloop.models import resolve_model_dir
from liveloop.server.engine.sglang.launcher import SGLangLauncher
from liveloop.valkey import EmbeddedValkey, free_port

ADMIN_KEY = "bench-admin"
API_KEY = "bench-api"  # the admin key may not also open the chat API


async def sse(client: httpx.AsyncClient, url: str, body: dict[str, Any], kind: str) -> list[float]:
    """Arrival time of every token of one stream (request start first)."""
    times = [time.perf_counter()]
    seen = 0
    async with client.stream(
        "POST", url, json=body, headers={"Authorization": f"Bearer {API_KEY}"}
    ) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            data = json.loads(line[5:])
            if kind == "direct":
                total = int(data["meta_info"]["completion_tokens"])
            else:
                delta = data["choices"][0]["delta"] if data.get("choices") else {}
                total = seen + (1 if delta.get("content") else 0)
            now = time.perf_counter()
            times += [now] * (total - seen)
            seen = total
    return times


def summary(runs: list[list[float]], wall: float) -> dict[str, float]:
    """Median TTFT, total tokens/s and largest inter-token gap of a set of streams."""
    tokens = sum(len(t) - 1 for t in runs)
    gaps = [b - a for t in runs for a, b in itertools.pairwise(t[1:])]
    return {
        "ttft_s": round(statistics.median(t[1] - t[0] for t in runs if len(t) > 1), 4),
        "tokens_per_s": round(tokens / wall, 2),
        "max_gap_s": round(max(gaps, default=0.0), 4),
    }


async def wave(target: dict[str, Any], streams: int, args: argparse.Namespace) -> dict[str, float]:
    """`streams` concurrent streams of `max_tokens` tokens against one target."""
    async with httpx.AsyncClient(timeout=600) as client:
        started = time.perf_counter()
        runs = await asyncio.gather(
            *(sse(client, target["url"], target["body"](i), target["kind"]) for i in range(streams))
        )
        return summary(list(runs), time.perf_counter() - started)


def targets(
    gateway: str, replica: str, prompt: list[int], model: str, args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """The same request through the gateway and straight to one replica."""
    messages = [{"role": "user", "content": "Tell me a long story about the sea."}]

    def chat(i: int) -> dict[str, Any]:
        return {
            "model": model,
            "messages": messages,
            "max_tokens": args.max_tokens,
            "stream": True,
            "ignore_eos": True,
            "temperature": 1.0,
            "seed": i,
        }

    def direct(i: int) -> dict[str, Any]:
        params = {
            "max_new_tokens": args.max_tokens,
            "ignore_eos": True,
            "temperature": 1.0,
            "sampling_seed": i,
        }
        return {
            "input_ids": prompt,
            "sampling_params": params,
            "stream": True,
            "return_logprob": True,
        }

    return {
        "gateway": {"url": gateway + "/v1/chat/completions", "body": chat, "kind": "gateway"},
        "direct": {"url": replica + "/generate", "body": direct, "kind": "direct"},
    }


def perturbed_copy(model_dir: Path, out: Path) -> Path:
    """A new "version": the model with its norm weights scaled (numpy, no torch)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(model_dir, out)
    for file in out.glob("*.safetensors"):
        tensors = load_file(str(file))
        save_file(
            {k: v * 1.01 if "norm" in k else v for k, v in tensors.items()},
            str(file),
            metadata={"format": "pt"},
        )
    return out


async def rolling_gap(
    gateway: str, chat: dict[str, Any], checkpoint: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """Largest inter-token gap of in-flight streams with and without a rolling update."""
    quiet = await wave(chat, args.update_streams, args)

    async def update() -> float:
        await asyncio.sleep(args.settle_s)
        started = time.perf_counter()
        async with httpx.AsyncClient(timeout=900) as client:
            answer = await client.post(
                gateway + "/admin/weights",
                json={"path": str(checkpoint), "version": 1},
                headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            )
        answer.raise_for_status()
        return time.perf_counter() - started

    busy, took = await asyncio.gather(wave(chat, args.update_streams, args), update())
    return {
        "no_update_max_gap_s": quiet["max_gap_s"],
        "rolling_update_max_gap_s": busy["max_gap_s"],
        "rolling_update_s": round(took, 2),
        "streams": args.update_streams,
    }


def start_gateway(
    urls: list[str], valkey: str, model: str, data: Path
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = dict(os.environ, LIVELOOP_ADMIN_KEY=ADMIN_KEY, LIVELOOP_API_KEYS=API_KEY)
    cmd = [
        sys.executable,
        "-m",
        "liveloop.cli",
        "serve",
        "--engine",
        "sglang",
        "--sglang-url",
        ",".join(urls),
        "--model",
        model,
        "--port",
        str(port),
        "--redis-url",
        valkey,
        "--data-dir",
        str(data),
        "--log-level",
        "WARNING",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:  # exited (e.g. a configuration error): stop waiting
            break
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the gateway did not become ready")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import PreTrainedTokenizerFast

    from liveloop.server.tools import ChatTemplate

    model_dir = resolve_model_dir(args.model)
    work = Path(tempfile.mkdtemp(prefix="bench-sglang-"))
    launcher = None
    urls = [u for u in (args.sglang_url or "").split(",") if u]
    if args.launch:
        env = dict(item.split("=", 1) for item in args.launch_env)
        cfg = SGLangConfig(
            launch=args.launch,
            device=args.device,
            python=args.python,
            launch_env=env,
            launch_args=args.launch_arg,
        )
        launcher = SGLangLauncher(str(model_dir), cfg, work / "logs")
        urls += await launcher.start()
    valkey = EmbeddedValkey(work / "valkey")
    valkey.start()
    gateway_proc, gateway = start_gateway(urls, valkey.url, args.model, work / "data")
    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
        prompt = ChatTemplate(tokenizer).render_ids(
            [{"role": "user", "content": "Tell me a long story about the sea."}], None
        )
        both = targets(gateway, urls[0], prompt, args.model, args)
        await wave(both["gateway"], 1, args)  # warm-up (prefix cache, connections)
        await wave(both["direct"], 1, args)
        result: dict[str, Any] = {
            "model": args.model,
            "device": args.device if args.launch else "given",
            "replicas": len(urls),
            "max_tokens": args.max_tokens,
        }
        for streams in (1, 8):
            for name in ("direct", "gateway"):
                result[f"{name}_{streams}_streams"] = await wave(both[name], streams, args)
        if len(urls) >= 2:
            checkpoint = perturbed_copy(model_dir, work / "v1")
            result["rolling_update"] = await rolling_gap(gateway, both["gateway"], checkpoint, args)
        return result
    finally:
        gateway_proc.terminate()
        gateway_proc.wait(30)
        valkey.stop()
        if launcher is not None:
            await launcher.stop()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--sglang-url", help="running SGLang servers, comma-separated")
    parser.add_argument("--launch", type=int, default=0, help="start this many SGLang servers")
    parser.add_argument("--device", default="cuda", help="device of launched servers")
    parser.add_argument("--python", help="interpreter with SGLang for launched servers")
    parser.add_argument("--launch-env", action="append", default=[], help="NAME=VALUE")
    parser.add_argument("--launch-arg", action="append", default=[], help="extra server flag")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--update-streams", type=int, default=4)
    parser.add_argument("--settle-s", type=float, default=2.0, help="stream this long first")
    args = parser.parse_args()
    if not args.sglang_url and not args.launch:
        parser.error("give --sglang-url or --launch N")
    json.dump(asyncio.run(main_async(args)), sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
