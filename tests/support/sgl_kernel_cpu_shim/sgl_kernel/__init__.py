"""CPU test support: a pure-torch stand-in for SGLang's `sgl_kernel` (not part of LiveLoop).

SGLang 0.5.23 on a CPU without AMX falls back to torch everywhere except one kernel,
`assign_req_to_token_pool_cpu`, implemented here. Every other name (and every submodule,
`sgl_kernel.kvcacheio` and the like) resolves to a stub that imports fine and raises
NotImplementedError if it is ever called, so a code path that would need a real kernel
fails loudly instead of computing something wrong.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

import torch

__version__ = "0.0.0+liveloop-cpu-test-shim"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For each request i in order, write its next `end - start` cache slots from
    `out_cache_loc` into `req_to_token[req_pool_indices[i], start[i]:end[i]]`."""
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    taken = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        count = end - start
        if count <= 0:
            continue
        req_to_token[row, start:end] = out_cache_loc[taken : taken + count].to(req_to_token.dtype)
        taken += count


class _Stub:
    """Any other kernel: importable, attribute chains allowed, raises when called."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Stub:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{self._name} is not available in the CPU test shim of sgl_kernel"
        )

    def __repr__(self) -> str:
        return f"<sgl_kernel CPU-shim stub {self._name}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self.__name__}.{attr}")


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes every `sgl_kernel.<sub>` import a stub module."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Stub(f"sgl_kernel.{name}")


sys.meta_path.insert(0, _SubmoduleFinder())
