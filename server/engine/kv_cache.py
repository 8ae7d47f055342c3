"""A batched KV cache whose rows join and leave while the batch keeps decoding.

Why this layout: continuous batching needs one attention call per layer for sequences of
different lengths. Every row's keys/values are right-aligned on a shared time axis: row i
holds its `lengths[i]` cached positions in columns `[end - lengths[i], end)`, so a decode
step writes every row's new key into the same column `end` (one strided copy, no per-step
copy of the cache) and attends over the window `[start, end]` with a padding mask. The
buffers are only re-laid out (a copy of the live window) when a joiner is longer than the
current window or the time axis runs out of room; a leaving row is replaced by the last
row (a copy of one row).
"""

from __future__ import annotations

import torch

MIN_SLACK = 64  # free columns kept after a re-layout, so re-layouts stay rare


class BatchKVCache:
    """Per-layer K/V buffers `[max_rows, kv_heads, capacity, head_dim]`, right-aligned."""

    def __init__(
        self,
        *,
        num_layers: int,
        max_rows: int,
        kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str,
        initial_capacity: int = 256,
    ) -> None:
        self.num_layers = num_layers
        self.max_rows = max_rows
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.max_len = max_len
        self.dtype = dtype
        self.device = torch.device(device)
        self.lengths: list[int] = []
        self.end = 0
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.relayouts = 0
        self._initial_capacity = initial_capacity

    @property
    def rows(self) -> int:
        """Number of sequences in the batch."""
        return len(self.lengths)

    @property
    def start(self) -> int:
        """First column any row still uses."""
        return self.end - max(self.lengths, default=0)

    def clear(self) -> None:
        """Drop every row (the buffers are kept for reuse)."""
        self.lengths = []
        self.end = 0

    def add_row(self, length: int) -> int:
        """Reserve the next row for a sequence of `length` cached positions; returns it."""
        if self.rows >= self.max_rows:
            raise RuntimeError("KV cache has no free row")
        if self.rows == 0 and length + 1 <= self.capacity:
            self.end = length  # empty batch: reuse the buffers, nothing to move
        elif length > self.end:
            self._relayout(max(length, self.end - self.start), extra=1)
        self.lengths.append(length)
        return self.rows - 1

    def write_prefill(self, layer: int, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a joiner's prompt keys/values `[kv_heads, L, head_dim]` in its row."""
        length = k.shape[1]
        self.keys[layer][row, :, self.end - length : self.end] = k
        self.values[layer][row, :, self.end - length : self.end] = v

    def prepare_decode(self) -> None:
        """Make sure column `end` exists for the next decode step."""
        if self.end + 1 > self.capacity:
            self._relayout(self.end - self.start, extra=1)

    def write_decode(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store every row's new key/value `[rows, kv_heads, head_dim]` in column `end`."""
        self.keys[layer][: self.rows, :, self.end] = k
        self.values[layer][: self.rows, :, self.end] = v

    def window(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of columns `[start, end]` (the decode step's attention span)."""
        cols = slice(self.start, self.end + 1)
        return self.keys[layer][: self.rows, :, cols], self.values[layer][: self.rows, :, cols]

    def decode_mask(self) -> torch.Tensor | None:
        """Bool mask `[rows, 1, 1, window]` of valid columns, or None when all are valid."""
        longest = max(self.lengths)
        if all(n == longest for n in self.lengths):
            return None
        cols = torch.arange(self.start, self.end + 1, device=self.device)
        first = torch.tensor([self.end - n for n in self.lengths], device=self.device)
        return (cols[None, :] >= first[:, None])[:, None, None, :]

    def advance(self) -> None:
        """Account for the column written by the decode step just run."""
        self.end += 1
        self.lengths = [n + 1 for n in self.lengths]

    def row_copy(self, row: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies of one row's cached keys and values, `[1, kv_heads, length, head_dim]`."""
        cols = slice(self.end - self.lengths[row], self.end)
        keys = [k[row : row + 1, :, cols].clone() for k in self.keys]
        return keys, [v[row : row + 1, :, cols].clone() for v in self.values]

    def remove_row(self, row: int) -> None:
        """Drop a row; the last row moves into its place (callers mirror that move)."""
        last = self.rows - 1
        if row != last:
            cols = slice(self.end - self.lengths[last], self.end)
            for buf in (*self.keys, *self.values):
                buf[row, :, cols] = buf[last, :, cols]
            self.lengths[row] = self.lengths[last]
        self.lengths.pop()
        if not self.lengths:
            self.end = 0

    def _relayout(self, width: int, extra: int) -> None:
        """Move the live window so it ends at column `width`, growing the buffers if needed."""
        capacity = self._capacity_for(width + extra)
        live = self.end - self.start
        src, dst = slice(self.start, self.end), slice(width - live, width)
        if capacity != self.capacity:
            old = (*self.keys, *self.values)
            shape = (self.max_rows, self.kv_heads, capacity, self.head_dim)
            self.keys = [self._zeros(shape) for _ in range(self.num_layers)]
            self.values = [self._zeros(shape) for _ in range(self.num_layers)]
            if self.rows and live:
                for new, buf in zip((*self.keys, *self.values), old, strict=True):
                    new[: self.rows, :, dst] = buf[: self.rows, :, src]
        elif self.rows and live and src != dst:
            for buf in (*self.keys, *self.values):
                buf[: self.rows, :, dst] = buf[: self.rows, :, src].clone()
        self.end = width
        self.capacity = capacity
        self.relayouts += 1

    def _capacity_for(self, needed: int) -> int:
        """Current capacity if it leaves enough slack after `needed`, else a grown one."""
        if self.capacity >= needed + min(MIN_SLACK, self.capacity // 4):
            return self.capacity
        grown = max(needed + MIN_SLACK, 2 * self.capacity, self._initial_capacity)
        return max(min(grown, self.max_len + MIN_SLACK), needed)

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        # Zeros, not empty: padded columns are read (masked) and must never hold NaN.
        return torch.zeros(shape, dtype=self.dtype, device=self.device)
