"""DiffusionGemma's KV cache: full-attention layers keep every position, sliding layers only their window."""
from __future__ import annotations

import torch
from torch import Tensor

from unmask.models.attention import KVCache


class GemmaKVCache(KVCache):
    """Full-attention layers keep every position (as KVCache); sliding layers keep only what they can still read.

    A query at or after position `start` on a sliding layer reads keys from start - (W - 1) on (encoder rows:
    (p - W, p]; canvas rows: the last W - 1 cached positions), so each sliding buffer holds the absolute
    positions [base, base + rows). When a write would run past it, the positions from start - (W - 1) on move
    to the front (into a buffer twice what they and the write need, when the current one is too small or over
    four times too large). A sliding layer then costs O(W + longest segment) rows instead of O(context): the
    released model has five sliding layers to each full one.
    """

    def __init__(self, shapes: list[tuple[int, int]], sliding: list[bool], window: int, dtype: torch.dtype,
                 device: torch.device | str, capacity: int = 256, max_capacity: int | None = None):
        self.sliding = tuple(sliding)
        self.keep = window - 1
        self.base = 0    # absolute position of row 0 of every sliding buffer
        self.rows = 0    # rows of every sliding buffer
        super().__init__(shapes, dtype, device, capacity, max_capacity)  # full layers (KVCache._grow)
        self._move_window(0, min(capacity, 2 * (self.keep + 1)))

    def _absolute(self, layer: int) -> bool:
        return not self.sliding[layer]

    def _alloc(self, layer: int, rows: int) -> Tensor:
        h, d = self.shapes[layer]
        return torch.empty(h, rows, d, dtype=self.dtype, device=self.device)

    def _move_window(self, first: int, rows: int) -> None:
        """Sliding buffers of `rows` rows starting at absolute position `first` (>= base), valid rows kept."""
        valid = max(0, self.length - first)
        src = first - self.base
        for i, windowed in enumerate(self.sliding):
            if not windowed:
                continue
            for store in (self.k, self.v):
                old = store[i]
                if rows != self.rows or old is None:
                    new = self._alloc(i, rows)
                    if valid:
                        new[:, :valid] = old[:, src:src + valid]
                    store[i] = new
                elif valid and src:
                    old[:, :valid] = old[:, src:src + valid].clone()  # ranges may overlap
        self.base, self.rows = first, rows

    def reserve(self, end: int, start: int | None = None) -> None:
        self._grow(end)
        start = self.length if start is None else min(start, self.length)
        first = max(0, start - self.keep)  # the first position a sliding layer still reads
        if first < self.base:
            raise ValueError(f"sliding-window cache: position {first} was already dropped (kept from {self.base})")
        need = end - first
        big = 4 * max(need, 32)  # a buffer over this is shrunk (after a long prefill chunk)
        if end - self.base <= self.rows <= big:
            return
        # room for twice what is needed, so that compactions are rare, but not past the request's last position
        target = max(2 * need, 64)
        if self.max_capacity is not None:
            target = max(need, min(target, self.max_capacity - first))
        self._move_window(first, self.rows if target <= self.rows <= big else target)

    def first_position(self, layer: int) -> int:
        """The absolute position stored in row 0 of this layer's buffers."""
        return self.base if self.sliding[layer] else 0
