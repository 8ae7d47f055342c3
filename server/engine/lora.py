"""Batched LoRA arithmetic: every row of a batch adds its own adapter's low-rank update.

Why a module of its own: the torch engine decodes requests on different adapters in one
batch, so a projection `y = x W^T` becomes `y = x W^T + s_a (x A_a^T) B_a^T` with a
different adapter `a` per row. The adapters resident in memory live stacked in a
`LoraBank` (one `[slots, in, rank]` and one `[slots, rank, out]` tensor per adapted
linear, the scaling folded into B, ranks zero-padded to the largest), and a `LoraStep`
says which slot each row of one forward call uses. Slot 0 is all zeros: the base model.

Two ways to apply a step, picked from the batch: when every adapted row shares one slot,
two plain matmuls on views of that slot (nothing is copied); otherwise the A and B of
each adapter in the step are gathered once and applied with `bmm` to that adapter's rows
(grouped and padded to equal counts). Plain tensors only, no model: unit-testable on
their own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

# Which linear of which layer: (layer index, projection name such as "q_proj").
ModuleKey = tuple[int, str]


@dataclass(frozen=True)
class LoraPair:
    """One adapted linear of one adapter: `A [rank, in]`, `B [out, rank]`, scaling."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        """The adapter's rank on this linear."""
        return int(self.a.shape[0])


class LoraBank:
    """The resident adapters' matrices, stacked by slot (slot 0 is the base: zeros).

    Written only between forward calls (the engine's decode thread). `shapes` gives each
    adaptable linear's `(in, out)`; a linear no resident adapter touches has no tensors,
    and a slot whose adapter does not touch a linear holds zeros there.
    """

    def __init__(
        self,
        shapes: Mapping[ModuleKey, tuple[int, int]],
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.shapes = dict(shapes)
        self.dtype = dtype
        self.device = torch.device(device)
        self.capacity = 1  # slots allocated, the zero slot included
        self.rank = 0  # largest rank of any slot (the padded width)
        self.a: dict[ModuleKey, torch.Tensor] = {}  # [capacity, in, rank]
        self.b: dict[ModuleKey, torch.Tensor] = {}  # [capacity, rank, out], scaled
        self._modules: dict[int, frozenset[ModuleKey]] = {}  # slot -> linears it adapts

    def modules_of(self, slot: int) -> frozenset[ModuleKey]:
        """The linears a slot adapts."""
        return self._modules.get(slot, frozenset())

    def put(self, slot: int, pairs: Mapping[ModuleKey, LoraPair]) -> None:
        """Write an adapter into `slot` (>= 1), replacing whatever was there."""
        if slot < 1:
            raise ValueError("slot 0 is the base model and stays zero")
        unknown = sorted(set(pairs) - set(self.shapes))
        if unknown:
            raise ValueError(f"no adaptable linear {unknown[0]}")
        rank = max((p.rank for p in pairs.values()), default=0)
        self._grow(max(self.capacity, slot + 1), max(self.rank, rank), pairs)
        self.clear(slot)
        for key, pair in pairs.items():
            r = pair.rank
            a, b = self.a[key], self.b[key]
            a[slot, :, :r] = pair.a.to(a.dtype).t()
            b[slot, :r, :] = (pair.b.to(torch.float32) * pair.scaling).to(b.dtype).t()
        self._modules[slot] = frozenset(pairs)

    def clear(self, slot: int) -> None:
        """Zero a slot (its adapter left memory)."""
        for key in self._modules.pop(slot, frozenset()):
            self.a[key][slot].zero_()
            self.b[key][slot].zero_()

    def _grow(self, capacity: int, rank: int, pairs: Iterable[ModuleKey]) -> None:
        """Make room for `capacity` slots of `rank`, and tensors for the linears in `pairs`."""
        if capacity == self.capacity and rank == self.rank:
            for key in pairs:
                if key not in self.a:
                    self._allocate(key, capacity, rank)
            return
        old_rank = self.rank
        self.capacity, self.rank = capacity, rank
        for key in list(self.a):
            old_a, old_b = self.a[key], self.b[key]
            self._allocate(key, capacity, rank)
            self.a[key][: old_a.shape[0], :, :old_rank] = old_a
            self.b[key][: old_b.shape[0], :old_rank, :] = old_b
        for key in pairs:
            if key not in self.a:
                self._allocate(key, capacity, rank)

    def _allocate(self, key: ModuleKey, capacity: int, rank: int) -> None:
        fan_in, fan_out = self.shapes[key]
        self.a[key] = torch.zeros(capacity, fan_in, rank, dtype=self.dtype, device=self.device)
        self.b[key] = torch.zeros(capacity, rank, fan_out, dtype=self.dtype, device=self.device)


class LoraStep:
    """Which slot each row of one forward call uses, and how to apply them (see module doc).

    `slots[i]` is row i's slot; 0 means the base model. `x` passed to `delta` is
    `[rows, seq, in]` with one row per slot.
    """

    def __init__(self, bank: LoraBank, slots: list[int]) -> None:
        self.bank = bank
        self.slots = slots
        groups: dict[int, list[int]] = {}
        for row, slot in enumerate(slots):
            if slot:
                groups.setdefault(slot, []).append(row)
        self.active = bool(groups)
        self.single: int | None = next(iter(groups)) if len(groups) == 1 else None
        self._mask: torch.Tensor | None = None
        self._plan: _Grouped | None = None
        device = bank.device
        if self.single is not None and 0 in slots:  # base rows mixed with one adapter
            flags = [1.0 if s else 0.0 for s in slots]
            self._mask = torch.tensor(flags, dtype=bank.dtype, device=device).view(-1, 1, 1)
        elif len(groups) > 1:
            self._plan = _Grouped(groups, len(slots), device)

    def adapts(self, key: ModuleKey) -> bool:
        """Whether any row of this step has an update for the linear `key`."""
        if not self.active or key not in self.bank.a:
            return False
        if self.single is not None:
            return key in self.bank.modules_of(self.single)
        return True

    def delta(self, key: ModuleKey, x: torch.Tensor) -> torch.Tensor | None:
        """The rows' low-rank updates `[rows, seq, out]` of linear `key`, or None if none."""
        if not self.adapts(key):
            return None
        a, b = self.bank.a[key], self.bank.b[key]
        if self.single is not None:
            out = (x @ a[self.single]) @ b[self.single]
            return out * self._mask if self._mask is not None else out
        assert self._plan is not None
        return self._plan.apply(x, a, b)


class _Grouped:
    """Rows on several adapters: each adapter's rows are laid out as one batch of a `bmm`
    (`[adapters, rows per adapter]`, padded to the largest group with copies of a row whose
    results are dropped) against that adapter's A and B.

    When the adapters' slots span a range at most twice their number, the bank's tensors
    are used as they are over that range (a view: slots in between get no rows), which
    reads each adapter's weights once; otherwise the slots are gathered into copies.
    """

    def __init__(self, groups: dict[int, list[int]], rows: int, device: torch.device) -> None:
        lo, hi = min(groups), max(groups)
        self.span: tuple[int, int] | None = None
        if hi - lo + 1 <= 2 * len(groups):
            self.span = (lo, hi + 1)
            groups = {slot: groups.get(slot, []) for slot in range(lo, hi + 1)}
        width = max(len(g) for g in groups.values())
        order: list[int] = []
        back = [0] * rows
        for g, members in enumerate(groups.values()):
            for j, row in enumerate(members):
                back[row] = g * width + j
            order += members + [members[0] if members else 0] * (width - len(members))
        adapted = sorted(row for members in groups.values() for row in members)
        self.groups, self.width, self.rows = len(groups), width, rows
        self.slots = torch.tensor(list(groups), dtype=torch.long, device=device)
        self.order = torch.tensor(order, dtype=torch.long, device=device)
        self.adapted: torch.Tensor | None = None  # rows with an adapter, if not all
        if len(adapted) < rows:
            self.adapted = torch.tensor(adapted, dtype=torch.long, device=device)
            back = [back[row] for row in adapted]
        self.back = torch.tensor(back, dtype=torch.long, device=device)

    def _take(self, stacked: torch.Tensor) -> torch.Tensor:
        if self.span is not None:
            return stacked[self.span[0] : self.span[1]]
        return stacked.index_select(0, self.slots)

    def apply(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        seq, fan_in = x.shape[1], x.shape[2]
        xs = x.index_select(0, self.order).reshape(self.groups, self.width * seq, fan_in)
        up = torch.bmm(torch.bmm(xs, self._take(a)), self._take(b))
        up = up.reshape(self.groups * self.width, seq, -1).index_select(0, self.back)
        if self.adapted is None:
            return up
        out = up.new_zeros(self.rows, seq, up.shape[-1])
        return out.index_copy_(0, self.adapted, up)


def apply_linear(
    module: torch.nn.Module, x: torch.Tensor, lora: LoraStep | None, key: ModuleKey
) -> torch.Tensor:
    """`module(x)` plus each row's LoRA update of that linear (when the step has one)."""
    y: torch.Tensor = module(x)
    if lora is None:
        return y
    update = lora.delta(key, x)
    return y if update is None else y.add_(update)
