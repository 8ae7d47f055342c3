"""Which weights serve a request: the base, the shared adapter, or the caller's own adapter.

The trainer may publish LoRA adapters instead of full weights (`trainer.publish`), under
one shared name, or one per tenant (tenant scope). The weight follower tells this table
which adapters were announced for whom (`announced`); a chat request asks it which adapter
to run on (`for_tenant`): the tenant's own adapter if one is being served, else the shared
adapter if one is, else the base model. A tenant's adapter never serves another tenant.
"""

from __future__ import annotations

from collections.abc import Callable


class AdapterRouting:
    """Adapter names by tenant, and the shared one, as the weight announcements said."""

    def __init__(self, served: Callable[[], dict[str, int]]) -> None:
        self._served = served  # the engine's adapters now: name -> version
        self.shared: str | None = None  # the shared adapter's name, once one was announced
        self.by_tenant: dict[str, str] = {}  # tenant -> its adapter's name

    def announced(self, adapter: str, tenant: str | None) -> None:
        """An adapter version was loaded: route `tenant`'s requests (or everyone's) to it."""
        if tenant is None:
            self.shared = adapter
        else:
            self.by_tenant[tenant] = adapter

    def forget_tenant(self, tenant: str) -> str | None:
        """The tenant left: its requests go to the shared adapter or the base; its adapter."""
        return self.by_tenant.pop(tenant, None)

    def forget_adapter(self, adapter: str) -> None:
        """An adapter is no longer served (unloaded)."""
        if self.shared == adapter:
            self.shared = None
        self.by_tenant = {t: a for t, a in self.by_tenant.items() if a != adapter}

    def for_tenant(self, tenant: str) -> str | None:
        """The adapter a request of `tenant` runs on (None: the base model)."""
        served = self._served()
        own = self.by_tenant.get(tenant)
        if own is not None and own in served:
            return own
        if self.shared is not None and self.shared in served:
            return self.shared
        return None

    def version_of(self, adapter: str | None, base_version: int) -> int:
        """The version a request on `adapter` starts on (the base's for None)."""
        if adapter is None:
            return base_version
        return self._served().get(adapter, base_version)
