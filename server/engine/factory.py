"""The one place that turns settings into an engine (`server.engine`)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from liveloop.config import ConfigError

if TYPE_CHECKING:
    from liveloop.config import ServerConfig, SharedSettings
    from liveloop.models import LoadedModel
    from liveloop.server.engine.base import EngineClient


async def create_engine(
    shared: SharedSettings,
    cfg: ServerConfig,
    *,
    model: LoadedModel | None = None,
    spawned: EngineClient | None = None,
) -> EngineClient:
    """The engine the settings ask for, not yet started.

    - `sglang`: a gateway to the SGLang servers of `server.sglang_urls` (or launched);
    - `torch` with `server.engine_process`: the torch engine in a worker process
      (`spawned`, when `liveloop serve` already started it before the event loop);
    - `torch` without: the torch engine on a thread of this process (`model`, if loaded).
    """
    if spawned is not None:
        return spawned
    if cfg.engine == "sglang":
        from liveloop.server.engine.sglang import SGLangEngine

        return SGLangEngine.from_config(shared, cfg)
    if cfg.engine != "torch":  # pragma: no cover - the config's Literal allows no other
        raise ConfigError(f"server.engine: unknown engine {cfg.engine!r}")
    if cfg.engine_process:
        from liveloop.server.engine.process import EngineOptions, EngineProcess

        return EngineProcess(EngineOptions.from_config(shared.model, cfg))
    from liveloop.models import load_model
    from liveloop.server.engine.torch_engine import TorchEngine

    loaded = model
    if loaded is None:
        loaded = await asyncio.to_thread(load_model, shared.model, cfg.device)
    return TorchEngine(
        loaded.model,
        loaded.tokenizer,
        max_batch_size=cfg.max_batch_size,
        max_model_len=cfg.max_model_len,
        device=cfg.device,
        threads=cfg.torch_threads,
        max_loaded_adapters=cfg.max_loaded_adapters,
    )
