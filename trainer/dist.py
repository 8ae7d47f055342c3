"""The few collectives the trainer needs, for one process or several.

Under `accelerate launch` (or any launcher that sets RANK/WORLD_SIZE) the process group is
initialised through accelerate (gloo on CPU, NCCL on GPUs). Data parallelism is plain:
every rank holds the full model, trains on its share of each minibatch, and the gradients
are summed with one all-reduce before the (identical) optimizer step on every rank. Rank 0
alone talks to Redis, the registry and the disk, and broadcasts each batch to the others.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from liveloop.quality import DriftSums

if TYPE_CHECKING:
    import torch


class Comm:
    """Rank, world size and collectives; every operation is a no-op for one process."""

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        self.rank = rank
        self.world = world

    @classmethod
    def from_environment(cls, device: str = "cpu") -> Comm:
        """Join the process group set up by the launcher, if there is one."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return cls()
        from accelerate import PartialState

        state = PartialState(cpu=device == "cpu")
        return cls(rank=state.process_index, world=state.num_processes)

    @property
    def is_main(self) -> bool:
        """True on the rank that does I/O."""
        return self.rank == 0

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def max_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Maximum over ranks, in place."""
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Replace every gradient by its sum over ranks (one flat all-reduce)."""
        if self.world == 1:
            return
        import torch

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.sum_(flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    def merge_drift(self, drift: dict[int, DriftSums]) -> dict[int, DriftSums]:
        """Per-version drift sums added over ranks (every rank gets the total)."""
        if self.world == 1:
            return drift
        import torch.distributed as dist

        parts: list[dict[int, DriftSums] | None] = [None] * self.world
        dist.all_gather_object(parts, drift)
        total: dict[int, DriftSums] = {}
        for part in parts:
            for version, sums in (part or {}).items():
                total.setdefault(version, DriftSums()).add(sums)
        return total

    def close(self) -> None:
        """Leave the process group."""
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
