"""The one interface everything in the server talks to, whichever engine makes the tokens.

Chat serving, health and readiness, `/v1/models`, the admin routes, the weight follower and
the metrics use only what `EngineClient` declares (after vLLM's `EngineClient`). Two
families implement it: the embedded torch engine (`TorchEngine` in the server process, or
`EngineProcess`, the same engine in a worker process) and the SGLang gateway
(`SGLangEngine`, a pool of SGLang servers). `create_engine` in `factory.py` picks one
from the settings.

What crosses this interface is plain data: prompt token ids, `SamplingParams` (with
structured output as a serializable `OutputSpec`, never a torch mask), `TokenOutput`s
back. That is what lets the SGLang gateway run in a process that never imports torch.

LoRA adapters are weights of their own, served side by side over the base: an adapter is
loaded under a name with a version (`load_adapter`, a PEFT adapter directory), a request
names the adapter it runs on (`generate(..., adapter=NAME)`), and each of its tokens
then carries that adapter's version instead of the base's.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar

from liveloop.server.engine.types import EngineError, EngineStats, SamplingParams

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from liveloop.server.engine.stream import TokenStream
    from liveloop.server.tools.spec import OutputSpec


class EngineClient(abc.ABC):
    """An engine as the server sees it: start/stop, generate, weights, state for probes.

    `generate` must be called on the event loop that reads the stream. `affinity` is a key
    (the session id) that an engine with several replicas keeps on one replica, so that
    replica's prefix cache is reused; single engines ignore it.
    """

    kind: ClassVar[str] = "abstract"

    # ----------------------------------------------------------------- lifecycle
    @abc.abstractmethod
    async def start(self) -> None:
        """Start serving (load the model, or reach the servers); raises if it cannot."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop; requests still open fail with EngineError."""

    # ----------------------------------------------------------------- what is served
    @property
    @abc.abstractmethod
    def tokenizer(self) -> Any:
        """The tokenizer of the served model (the server renders and tokenizes with it)."""

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Policy version being served (the newest one, while an update rolls out)."""

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int:
        """Longest prompt + completion, in tokens."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Width of the model's logits (token ids are below it)."""

    @property
    @abc.abstractmethod
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end a request unless `ignore_eos` is set."""

    # ----------------------------------------------------------------- load and health
    @property
    @abc.abstractmethod
    def is_running(self) -> bool:
        """True while requests can be served (readiness)."""

    @property
    @abc.abstractmethod
    def num_running(self) -> int:
        """Requests being decoded."""

    @property
    @abc.abstractmethod
    def num_waiting(self) -> int:
        """Requests queued for a slot."""

    @property
    def stats(self) -> EngineStats:
        """Cumulative decode counters, where the engine keeps them (else zeros)."""
        return EngineStats()

    def health(self) -> dict[str, Any]:
        """Details for `/readyz` (an engine with replicas lists them); JSON-serializable."""
        return {}

    def bind_metrics(self, registry: CollectorRegistry) -> None:  # noqa: B027 - optional hook
        """Register engine-specific Prometheus metrics (an engine may have none)."""

    # ----------------------------------------------------------------- requests
    @abc.abstractmethod
    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        affinity: str | None = None,
        adapter: str | None = None,
    ) -> TokenStream:
        """Queue a completion at once and stream its tokens.

        `adapter`: the LoRA adapter to run on (None: the base model); its tokens carry
        that adapter's version. Raises ContextLengthError / InvalidRequestError (bad
        input; UnknownAdapterError for an adapter not loaded) or EngineError (cannot
        serve) before anything is queued.
        """

    def check_grammar(self, grammar: OutputSpec) -> None:  # noqa: B027 - optional hook
        """Raise ToolRequestError if this engine cannot constrain output to `grammar`.

        Engines that compile grammars locally check here, so a bad schema is a 400 before
        the request is queued; the SGLang gateway leaves it to SGLang.
        """

    def clear_prefix_cache(self) -> None:  # noqa: B027 - optional hook
        """Forget cached prompt keys/values (benchmarks); a no-op where not supported."""

    # ----------------------------------------------------------------- weights
    @abc.abstractmethod
    async def load_weights(self, path: str, version: int) -> float:
        """Serve a checkpoint directory as `version`; returns the longest decode pause (s).

        Raises CheckpointError when the checkpoint is refused (serving goes on with the
        weights served before).
        """

    # ----------------------------------------------------------------- adapters
    async def load_adapter(self, name: str, version: int, path: str) -> float:
        """Serve the PEFT adapter directory `path` as adapter `name`, version `version`.

        Replaces the version of `name` served before (an older `version` is a rollback);
        requests running on it move to the new version between two decode steps, and
        neither the base weights nor any other adapter is touched. Returns the longest
        pause of generation it caused (s). Raises CheckpointError (`AdapterError`) when
        the adapter is refused (missing files, names or shapes that do not fit the base,
        NaN/inf): the version served before, if any, goes on serving.
        """
        raise EngineError(f"the {self.kind} engine does not serve adapters")

    async def unload_adapter(self, name: str) -> None:
        """Stop serving adapter `name`; requests already running on it finish on it.

        Raises UnknownAdapterError when no such adapter is loaded.
        """
        raise EngineError(f"the {self.kind} engine does not serve adapters")

    def adapters(self) -> dict[str, int]:
        """The adapters served: name -> version (none where adapters are not supported)."""
        return {}
