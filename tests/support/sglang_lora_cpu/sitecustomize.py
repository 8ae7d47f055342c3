"""Test support: SGLang's LoRA layers on a machine without CUDA (see README.md here).

SGLang's multi-LoRA code allocates host buffers with `pin_memory=True` and calls
`Tensor.pin_memory()`, both of which need a CUDA driver. Without CUDA, pinning has no
purpose: this drops the argument from torch's tensor factories and makes `pin_memory()`
return the tensor itself. Python imports this module at start-up when its directory is
on `PYTHONPATH`; it changes nothing where CUDA is available.
"""

from __future__ import annotations

import functools
from typing import Any

FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "empty_strided", "as_tensor")


def _unpinned(factory: Any) -> Any:
    @functools.wraps(factory)
    def call(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return call


def _patch() -> None:
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        return
    for name in FACTORIES:
        setattr(torch, name, _unpinned(getattr(torch, name)))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self  # type: ignore[method-assign]


_patch()
