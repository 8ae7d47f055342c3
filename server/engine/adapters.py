"""The LoRA adapters a torch engine serves: registered versions, memory slots, reloads.

Why: adapters are weights of their own (one per tenant, later), served side by side over
one frozen base. An adapter is *registered* once `load_adapter` accepted a version of it
(name -> version, path); it is *resident* while its tensors sit in a slot of the
`LoraBank`, which the decode step reads. At most `max_loaded` are resident: loading or
reloading one more evicts the least recently used adapter that no request is using, and an
evicted adapter is read again from its checkpoint when a request needs it (on a loader
thread, while the batch keeps decoding; the request waits in the queue meanwhile).

Everything here runs on the engine's decode thread (between two decode steps), except
`read` (any thread: file I/O and checks) and the reload reads on the loader thread, which
hand their result back through `finished_reloads`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from liveloop.server.engine.forward import LlamaRunner
from liveloop.server.engine.lora import LoraBank, LoraPair, LoraStep, ModuleKey
from liveloop.weights.adapter import AdapterError, read_adapter

log = logging.getLogger(__name__)

# (event name, value): "reload_wait" (seconds a request waited for its adapter to be read
# back), "eviction", "reload" and "reload_failed" (1 each).
AdapterEvents = Callable[[str, float], None]


@dataclass(eq=False)
class Adapter:
    """One registered adapter: its version now, and where its tensors are."""

    name: str
    version: int
    path: str
    generation: int  # new for every accepted version: keys the prefix cache
    slot: int = 0  # bank slot while resident or being reloaded into, else 0
    ready: bool = False  # its tensors are in the slot
    users: int = 0  # requests prefilling or decoding on it (they pin the slot)
    last_used: int = 0
    retired: bool = False  # unloaded: no new requests; the slot goes when users do


class AdapterTable:
    """Registered adapters and the bank slots of the resident ones (see module doc)."""

    def __init__(
        self,
        runner: LlamaRunner,
        max_loaded: int,
        wake: Callable[[], None],
        events: AdapterEvents | None = None,
    ) -> None:
        linears = runner.adaptable_linears()
        self._keys = {name: key for name, (key, _) in linears.items()}
        self._base = {name: tuple(t.shape) for name, t in runner.model.state_dict().items()}
        self.bank = LoraBank(
            {key: shape for key, shape in linears.values()},
            dtype=runner.dtype,
            device=runner.device,
        )
        self.max_loaded = max_loaded
        self.events = events
        self._wake = wake
        self._by_name: dict[str, Adapter] = {}
        self._slots: dict[int, Adapter] = {}  # slot -> the adapter holding it
        self._ticks = itertools.count(1)
        self._generations = itertools.count(1)
        self._loader: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # guards _finished (loader thread -> decode thread)
        self._finished: list[tuple[Adapter, int, dict[ModuleKey, LoraPair] | Exception]] = []
        self.versions: dict[str, int] = {}  # a snapshot other threads may read

    # ----------------------------------------------------------------- any thread
    def read(self, path: str) -> dict[ModuleKey, LoraPair]:
        """Read and check an adapter directory against the base model; AdapterError."""
        adapter = read_adapter(path, self._base)
        pairs: dict[ModuleKey, LoraPair] = {}
        for module, (a, b, scaling) in adapter.modules.items():
            key = self._keys.get(module)
            if key is None:
                raise AdapterError(f"{path}: the torch engine cannot apply LoRA to {module}")
            dtype = self.bank.dtype
            pairs[key] = LoraPair(a.to(dtype), b.to(dtype), scaling)
        return pairs

    def get(self, name: str) -> Adapter | None:
        """The registered adapter of that name (None: unknown or unloaded)."""
        return self._by_name.get(name)

    # ----------------------------------------------------------------- decode thread
    def install(
        self, name: str, version: int, path: str, pairs: dict[ModuleKey, LoraPair]
    ) -> Adapter:
        """Register a version (replacing the adapter's previous one in place)."""
        adapter = self._by_name.get(name)
        if adapter is None:
            adapter = Adapter(name, version, path, next(self._generations))
            self._by_name[name] = adapter
        adapter.version, adapter.path = version, path
        adapter.generation = next(self._generations)
        adapter.last_used = next(self._ticks)
        if adapter.slot or self._reserve(adapter):
            self._fill(adapter, pairs)  # rows on it move to this version at the next step
        self._snapshot()
        return adapter

    def unload(self, name: str) -> None:
        """Forget an adapter; requests decoding on it finish on it, then its slot is freed."""
        adapter = self._by_name.pop(name, None)
        if adapter is None:
            return
        adapter.retired = True
        if not adapter.users:
            self._free(adapter)
        self._snapshot()

    def acquire(self, adapter: Adapter) -> None:
        """A request starts prefilling on the adapter: pin its slot."""
        adapter.users += 1
        adapter.last_used = next(self._ticks)

    def release(self, adapter: Adapter) -> None:
        """A request on the adapter ended."""
        adapter.users -= 1
        adapter.last_used = next(self._ticks)
        if adapter.retired and not adapter.users:
            self._free(adapter)

    def ensure_loading(self, adapter: Adapter, keep: Collection[Adapter] = ()) -> bool:
        """A waiting request needs an evicted adapter: reload it if a slot can be had
        (without evicting an adapter of `keep`); whether it is being reloaded."""
        if adapter.slot:
            return True
        if not self._reserve(adapter, keep):
            return False
        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="adapter-loader")
        generation = adapter.generation
        log.info("reloading evicted adapter %s v%d", adapter.name, adapter.version)
        self._loader.submit(self._reload, adapter, generation, adapter.path)
        return True

    def finished_reloads(self) -> list[tuple[Adapter, Exception]]:
        """Install the reloads read since the last call; the adapters that failed to reload."""
        with self._lock:
            done, self._finished = self._finished, []
        failed: list[tuple[Adapter, Exception]] = []
        for adapter, generation, result in done:
            if adapter.generation != generation or adapter.ready or adapter.retired:
                continue  # a newer version arrived meanwhile (already installed), or gone
            if isinstance(result, Exception):
                self._emit("reload_failed", 1.0)
                self._free(adapter)
                failed.append((adapter, result))
            else:
                self._emit("reload", 1.0)
                self._fill(adapter, result)
        return failed

    def step(self, adapters: list[Adapter | None]) -> LoraStep | None:
        """The LoRA plan of one forward call over rows on these adapters (None: all base)."""
        slots = [a.slot if a is not None else 0 for a in adapters]
        return LoraStep(self.bank, slots) if any(slots) else None

    def stop(self) -> None:
        """Stop the loader thread (a reload in flight is dropped)."""
        if self._loader is not None:
            self._loader.shutdown(wait=False, cancel_futures=True)
            self._loader = None

    def emit_wait(self, seconds: float) -> None:
        """A request waited `seconds` for its evicted adapter to come back."""
        self._emit("reload_wait", seconds)

    # ----------------------------------------------------------------- internals
    def _reload(self, adapter: Adapter, generation: int, path: str) -> None:
        """Loader thread: read the adapter again and hand the result to the decode thread."""
        started = time.perf_counter()
        result: dict[ModuleKey, LoraPair] | Exception
        try:
            result = self.read(path)
        except Exception as exc:
            log.error("reloading adapter %s from %s failed: %s", adapter.name, path, exc)
            result = exc
        else:
            log.info("read adapter %s back in %.3fs", adapter.name, time.perf_counter() - started)
        with self._lock:
            self._finished.append((adapter, generation, result))
        self._wake()

    def _reserve(self, adapter: Adapter, keep: Collection[Adapter] = ()) -> bool:
        """Give the adapter a slot: a free one, or the least recently used idle adapter's."""
        taken = set(self._slots)
        free = [s for s in range(1, self.max_loaded + 1) if s not in taken]
        if not free:
            idle = [a for a in self._slots.values() if not a.users and a.ready and a not in keep]
            if not idle:
                return False
            victim = min(idle, key=lambda a: a.last_used)
            log.info("evicting adapter %s v%d from memory", victim.name, victim.version)
            self._emit("eviction", 1.0)
            free = [victim.slot]
            self._free(victim)
        adapter.slot, adapter.ready = free[0], False
        self._slots[adapter.slot] = adapter
        return True

    def _fill(self, adapter: Adapter, pairs: Mapping[ModuleKey, LoraPair]) -> None:
        self.bank.put(adapter.slot, pairs)
        if self.bank.device.type == "cuda":
            torch.cuda.synchronize(self.bank.device)
        adapter.ready = True

    def _free(self, adapter: Adapter) -> None:
        if adapter.slot:
            self.bank.clear(adapter.slot)
            self._slots.pop(adapter.slot, None)
        adapter.slot, adapter.ready = 0, False

    def _snapshot(self) -> None:
        self.versions = {name: a.version for name, a in self._by_name.items()}

    def _emit(self, event: str, value: float) -> None:
        if self.events is not None:
            try:
                self.events(event, value)
            except Exception:  # metrics must never break decoding
                log.exception("adapter event %s failed", event)
