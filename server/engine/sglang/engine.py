"""`SGLangEngine`: the server as a token-exact gateway in front of SGLang servers.

The server keeps doing what it does with the torch engine (chat template, tokenization,
session prefix extension, sessions, traces); this engine only moves token ids: it sends
the prompt ids to a replica's native `/generate` and hands back SGLang's own token ids,
behaviour log-probs and per-token weight versions. Replicas form a pool with session
affinity and health checks (`pool.py`); new weights roll across them one at a time
(`rolling.py`); the gateway validates a checkpoint before any replica sees it
(`checkpoints.py`); LoRA adapters go through SGLang's own multi-LoRA, loaded into the
replicas one at a time under versioned names (`adapters.py`, with `enable_lora`);
`launch > 0` starts local SGLang servers (`launcher.py`).

Nothing here imports torch: the tokenizer is loaded as a plain fast tokenizer, and the
model's limits come from its config files.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from liveloop.config import ConfigError, SGLangConfig
from liveloop.server.engine.base import EngineClient
from liveloop.server.engine.sglang.adapters import AdapterRollout, validate_adapter
from liveloop.server.engine.sglang.checkpoints import (
    TensorInfo,
    map_path,
    tensor_index,
    validate_checkpoint,
)
from liveloop.server.engine.sglang.client import ReplicaUnavailable, RequestRefused
from liveloop.server.engine.sglang.generation import Generation
from liveloop.server.engine.sglang.pool import Replica, ReplicaPool
from liveloop.server.engine.sglang.rolling import RollingUpdater, Target
from liveloop.server.engine.stream import RequestStream, check_request
from liveloop.server.engine.types import (
    EngineError,
    SamplingParams,
    TokenOutput,
    UnknownAdapterError,
)

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from liveloop.config import ServerConfig, SharedSettings
    from liveloop.server.engine.sglang.launcher import SGLangLauncher

log = logging.getLogger(__name__)

DEFAULT_CONTEXT = 2048


@dataclass
class ModelFacts:
    """What the gateway knows of the served model from its files (no weights loaded)."""

    directory: Path
    tokenizer: Any
    vocab_size: int
    context: int
    eos_token_ids: frozenset[int]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)


def load_model_facts(spec: str) -> ModelFacts:
    """Resolve the model, load its tokenizer (without torch) and read its limits."""
    from transformers import PreTrainedTokenizerFast

    from liveloop.models import resolve_model_dir

    directory = resolve_model_dir(spec)
    if (directory / "tokenizer.json").is_file():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(directory))
    else:  # pragma: no cover - slow tokenizers need transformers' auto classes
        from liveloop.models import load_tokenizer

        tokenizer = load_tokenizer(spec)
    config = json.loads((directory / "config.json").read_text())
    config = config.get("text_config", config)
    eos: set[int] = set()
    generation = directory / "generation_config.json"
    sources = [config.get("eos_token_id"), tokenizer.eos_token_id]
    if generation.is_file():
        sources.append(json.loads(generation.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            eos.add(value)
        elif isinstance(value, list):
            eos.update(int(v) for v in value)
    return ModelFacts(
        directory=directory,
        tokenizer=tokenizer,
        vocab_size=int(config.get("vocab_size") or len(tokenizer)),
        context=int(config.get("max_position_embeddings") or DEFAULT_CONTEXT),
        eos_token_ids=frozenset(eos),
        tensors=tensor_index(directory),
    )


class SGLangEngine(EngineClient):
    """The EngineClient of a pool of SGLang servers (see the module docstring)."""

    kind = "sglang"

    def __init__(
        self,
        model: str,
        config: SGLangConfig,
        max_model_len: int | None = None,
        log_dir: Path | None = None,
    ) -> None:
        if not config.urls and not config.launch:
            raise ConfigError(
                "server.sglang: name the SGLang servers (--sglang-url URL[,URL...]) "
                "or launch some (--launch N)"
            )
        self.model = model
        self.config = config
        self.log_dir = log_dir
        self._max_model_len_limit = max_model_len
        self._facts: ModelFacts | None = None
        self._launcher: SGLangLauncher | None = None
        self._pool: ReplicaPool | None = None
        self._updater: RollingUpdater | None = None
        self._rollout: AdapterRollout | None = None
        self._tasks: dict[str, tuple[asyncio.Task[None], Generation]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._max_model_len = 0

    @classmethod
    def from_config(cls, shared: SharedSettings, server: ServerConfig) -> SGLangEngine:
        """The engine of the shared settings and the `server` section (`server.sglang`)."""
        return cls(shared.model, server.sglang, server.max_model_len, shared.data_dir / "sglang")

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Read the model's files, launch servers if asked, find the replicas' versions."""
        if self._pool is not None:
            return
        cfg = self.config
        self._facts = await asyncio.to_thread(load_model_facts, self.model)
        urls = list(cfg.urls)
        if cfg.launch:
            from liveloop.server.engine.sglang.launcher import SGLangLauncher

            self._launcher = SGLangLauncher(str(self._facts.directory), cfg, self.log_dir)
            urls += await self._launcher.start()
        pool = ReplicaPool(
            urls,
            read_timeout_s=cfg.request_timeout_s,
            health_interval_s=cfg.health_interval_s,
            health_timeout_s=cfg.health_timeout_s,
            health_failures=cfg.health_failures,
        )
        updater = RollingUpdater(
            pool,
            pause_mode=cfg.pause_mode,
            update_timeout_s=cfg.update_timeout_s,
            backoff_s=cfg.retry_backoff_s,
        )
        self._pool, self._updater = pool, updater
        self._rollout = AdapterRollout(
            pool, timeout_s=cfg.update_timeout_s, backoff_s=cfg.retry_backoff_s
        )
        await asyncio.gather(*(updater.discover(r) for r in pool.replicas))
        if not pool.serving:
            await self.stop()
            raise EngineError(f"no SGLang server answered at {', '.join(urls)}")
        self._max_model_len = await self._context_window()
        versions = sorted({r.version for r in pool.serving})
        if len(versions) > 1:
            log.warning("SGLang replicas serve different versions %s", versions)
        pool.on_recovered = self._recover
        await pool.start()

    async def _recover(self, replica: Replica) -> None:
        """A replica answers again: bring its weights, then its adapters, up to date."""
        assert self._updater is not None and self._rollout is not None
        await self._updater.recover(replica)
        await self._rollout.recover(replica)

    async def _context_window(self) -> int:
        assert self._facts is not None and self._pool is not None
        window = self._facts.context
        if self._max_model_len_limit:
            window = min(window, self._max_model_len_limit)
        for replica in self._pool.serving:
            try:
                info = await replica.client.server_info()
            except (ReplicaUnavailable, RequestRefused):
                continue
            for key in ("context_length", "max_total_num_tokens"):
                value = info.get(key)
                if isinstance(value, int) and value > 0:
                    window = min(window, value)
        return window

    async def stop(self) -> None:
        """Fail open requests, stop health checks and retries, stop launched servers."""
        for task, _ in list(self._tasks.values()):
            task.cancel()
        self._tasks.clear()
        if self._updater is not None:
            await self._updater.stop()
        if self._rollout is not None:
            await self._rollout.stop()
        if self._pool is not None:
            await self._pool.stop()
        self._pool = self._updater = self._rollout = None
        if self._launcher is not None:
            await self._launcher.stop()
            self._launcher = None

    # ----------------------------------------------------------------- properties
    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (loaded by `start()`)."""
        return self._facts.tokenizer if self._facts is not None else None

    @property
    def version(self) -> int:
        """The newest version a replica in the pool serves."""
        return self._updater.version if self._updater is not None else 0

    @property
    def max_model_len(self) -> int:
        """The context window: the model's, capped by the replicas' limits."""
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (token ids are checked against it: SGLang 0.5
        crashes on an id outside it)."""
        return self._facts.vocab_size if self._facts is not None else 0

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """End-of-sequence ids from the model's config files."""
        return self._facts.eos_token_ids if self._facts is not None else frozenset()

    @property
    def is_running(self) -> bool:
        """True while at least one replica is in the pool."""
        return self._pool is not None and bool(self._pool.serving)

    @property
    def num_running(self) -> int:
        """Requests open through the gateway (not yet finished)."""
        return sum(1 for _task, generation in self._tasks.values() if not generation.finished)

    @property
    def num_waiting(self) -> int:
        """Queued requests wait inside SGLang, not here."""
        return 0

    def health(self) -> dict[str, Any]:
        """The replicas, for /readyz."""
        if self._pool is None:
            return {"engine": self.kind, "replicas": []}
        return {"engine": self.kind, "replicas": [r.describe() for r in self._pool.replicas]}

    def bind_metrics(self, registry: CollectorRegistry) -> None:
        """Per-replica gauges and counters."""
        from liveloop.server.engine.sglang.metrics import ReplicaCollector

        if self._pool is not None:
            registry.register(ReplicaCollector(self._pool))

    # ----------------------------------------------------------------- requests
    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        affinity: str | None = None,
        adapter: str | None = None,
    ) -> RequestStream:
        """Send the request to the session's replica at once and stream its tokens.

        On an adapter, the session's replica among those serving it.
        """
        prompt = [int(t) for t in prompt_token_ids]
        check_request(prompt, params, self.vocab_size, self._max_model_len)
        if params.constraint is not None:
            raise EngineError("the SGLang engine takes structured output as `grammar` only")
        if self._pool is None or self._updater is None or not self._pool.serving:
            raise EngineError("no SGLang replica is available")
        if adapter is not None and adapter not in self.adapters():
            raise UnknownAdapterError(f"adapter {adapter!r} is not loaded")
        rid = request_id or uuid.uuid4().hex
        queue: asyncio.Queue[TokenOutput | Exception] = asyncio.Queue()
        generation = Generation(
            self._pool,
            prompt,
            params,
            min(params.max_tokens, self._max_model_len - len(prompt)),
            rid,
            affinity,
            queue,
            resume_attempts=self.config.resume_attempts,
            base_version=self._updater.base_version,
            adapter=adapter,
            rollout=self._rollout,
        )
        self._loop = asyncio.get_running_loop()
        task = self._loop.create_task(generation.run(), name=f"sglang-{rid}")
        self._tasks[rid] = (task, generation)
        task.add_done_callback(lambda _t: self._tasks.pop(rid, None))
        return RequestStream(queue, lambda: self._cancel(rid))

    def _cancel(self, rid: str) -> None:
        """Drop a request; safe from any thread (a stream may be collected anywhere)."""
        loop = self._loop
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if not on_loop:
            if loop is not None and not loop.is_closed():
                with contextlib.suppress(RuntimeError):  # closed meanwhile: nothing to drop
                    loop.call_soon_threadsafe(self._cancel, rid)
            return
        entry = self._tasks.pop(rid, None)
        if entry is None:
            return
        task, generation = entry
        if not task.done():
            task.cancel()
            with_abort = asyncio.ensure_future(generation.cancel())
            with_abort.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    # ----------------------------------------------------------------- weights
    async def load_weights(self, path: str, version: int) -> float:
        """Validate the checkpoint here, then roll it across the replicas."""
        from liveloop.weights import CheckpointError

        if self._updater is None or self._facts is None:
            raise EngineError("engine is not running")
        local = Path(path)
        if self.config.check_checkpoints:
            await asyncio.to_thread(validate_checkpoint, local, self._facts.tensors)
        elif not str(path).strip():
            raise CheckpointError("empty checkpoint path")
        served = map_path(str(local.absolute()), self.config.path_map)
        return await self._updater.roll(Target(served, int(version)))

    # ----------------------------------------------------------------- adapters
    async def load_adapter(self, name: str, version: int, path: str) -> float:
        """Validate the adapter here, then load it into each replica in turn (see
        `adapters.py`); the longest single load (s). Base weights never pause."""
        if self._rollout is None or self._facts is None:
            raise EngineError("engine is not running")
        if not self.config.enable_lora:
            raise EngineError(
                "the SGLang engine serves adapters only with server.sglang.enable_lora"
            )
        local = Path(path)
        if self.config.check_checkpoints:
            await asyncio.to_thread(validate_adapter, local, self._facts.tensors, self.config)
        served = map_path(str(local.absolute()), self.config.path_map)
        return await self._rollout.load(name, int(version), served)

    async def unload_adapter(self, name: str) -> None:
        """Stop serving an adapter; each replica unloads it once its requests are done."""
        if self._rollout is None:
            raise EngineError("engine is not running")
        await self._rollout.unload(name)

    def adapters(self) -> dict[str, int]:
        """The adapters served: name -> version."""
        return self._rollout.versions() if self._rollout is not None else {}
