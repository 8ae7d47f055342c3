"""Settings of the serving loop (`liveloop serve`)."""

from typing import Literal

from pydantic import Field

from liveloop.config.base import Section
from liveloop.config.sglang import SGLangConfig


class KeyLimits(Section):
    """Request limits of one API key (of all callers together when the server is open)."""

    requests_per_minute: int = Field(
        0, ge=0, description="Requests a key may start per minute, on average; 0 = no limit."
    )
    burst: int | None = Field(
        None,
        ge=1,
        description="Requests a key may start at once on top of its rate (the token "
        "bucket's size); default: a tenth of a minute's requests, at least 1.",
    )
    concurrent_requests: int = Field(
        256,
        ge=0,
        description="Requests of a key in flight at once (a stream counts until it ends); "
        "0 = no limit.",
    )

    @property
    def effective_burst(self) -> int:
        """The bucket's size."""
        return self.burst or max(1, self.requests_per_minute // 10)


class ServerConfig(Section):
    """HTTP server, engine and trace capture settings."""

    engine: Literal["torch", "sglang"] = Field(
        "torch",
        description="Generation engine: 'torch' (embedded, in this host's process) or 'sglang' "
        "(this server becomes a gateway to the SGLang servers of `server.sglang`).",
    )
    engine_process: bool = Field(
        True,
        description="Run the torch engine in a worker process of its own. Off, it runs in a "
        "thread of the server process, where the HTTP event loop and the decode loop "
        "compete for one GIL (slower under load; simpler to debug).",
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="Intra-op torch threads of the engine (default: torch's, one per core). "
        "Steps of a few rows use one thread whatever this says.",
    )
    device: str = Field("cpu", description="Torch device for the embedded engine ('cpu', 'cuda').")
    max_batch_size: int = Field(
        16, ge=1, le=1024, description="Most sequences decoded together by the torch engine."
    )
    max_loaded_adapters: int = Field(
        8,
        ge=1,
        le=1024,
        description="Most LoRA adapters the torch engine holds in memory at once. Loading or "
        "needing one more evicts the least recently used idle one; a request on an evicted "
        "adapter waits while it is read back from its checkpoint.",
    )
    max_model_len: int | None = Field(
        None, ge=16, description="Context window in tokens; default: the model's, capped at 2048."
    )
    default_max_tokens: int = Field(
        256, ge=1, description="Completion tokens when a request names no max_tokens."
    )
    max_tokens_limit: int = Field(
        4096, ge=1, description="Largest max_tokens a request may ask for."
    )
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="Request body size limit; larger bodies get 413."
    )
    max_header_bytes: int = Field(
        32 * 1024,
        ge=1024,
        description="Largest request head (request line and headers); larger ones get 431.",
    )
    request_read_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A request (head and body) must arrive within this many seconds of its "
        "first byte (of the connection, for the first one); a head that does not gets 408.",
    )
    write_stall_timeout_s: float = Field(
        60.0,
        gt=0,
        description="A response whose writes stay blocked this long (the client stopped "
        "reading) is aborted, which cancels the request and frees its engine slot.",
    )
    keep_alive_timeout_s: int = Field(
        75,
        ge=1,
        description="An idle keep-alive connection is closed after this many seconds. Longer "
        "than the idle timeouts of the clients and proxies in front (httpx and the OpenAI "
        "SDK 5 s, load balancers often 60 s), so that they close first: a server closing "
        "first can reset a request the client sent on the connection at that moment.",
    )
    limits: KeyLimits = Field(
        default_factory=KeyLimits,
        description="Limits of every API key; over one, a request gets 429 with Retry-After.",
    )
    key_limits: dict[str, KeyLimits] = Field(
        default_factory=dict,
        description="Limits of particular keys, by key id (`key-...`, the tenant recorded with "
        "their turns; `liveloop key-id` prints a key's), instead of `limits`.",
    )
    trace_capture: bool = Field(
        True, description="Record turns to liveloop:turns (admins can pause/resume at run time)."
    )
    trace_durable_wait_s: float = Field(
        1.0,
        ge=0.0,
        description="Before a reply ends, wait up to this long until its turn record is in "
        "Redis or fsynced in the on-disk spool, so a crash right after a reply cannot lose its "
        "record (0: never wait; the record is written in the background either way).",
    )
    follow_weights: bool = Field(
        True, description="Follow liveloop:weights and hot-swap each new checkpoint."
    )
    sglang: SGLangConfig = Field(
        default_factory=SGLangConfig,
        description="The SGLang servers and how the gateway drives them (engine = 'sglang').",
    )
    session_ttl_s: int = Field(
        7 * 24 * 3600,
        ge=60,
        description="How long session state stays in Redis after its last turn.",
    )
