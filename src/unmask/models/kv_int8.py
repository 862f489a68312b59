"""A KV cache kept in int8 with one scale per token and head (`--kv-cache-dtype int8`), dequantised on read.

Each position of each KV head stores its head_dim values as round(x / s) in [-127, 127] with
s = max|x| / 127 of that head's vector (symmetric absmax rounding, as llama.cpp's q8_0 does per block of 32
values with an fp16 scale; here the block is one head's vector and the scale a float32). The scale's four
bytes sit after the values in the same int8 row ([kv heads, positions, head_dim + 4]), so anything that copies
a span of positions (the prefix cache's blocks, a pooled run's views) carries the scales with it.

Per position and head the cache takes head_dim + 4 bytes against 2 x head_dim in bfloat16 (the built-in
model: 68 against 128 bytes, 0.53x). Attention reads a layer back in the compute dtype: a dequantised copy of
that layer's K/V per forward, as a bfloat16 cache under float32 weights is cast (memory for time).
"""
from __future__ import annotations

import torch
from torch import Tensor

from unmask.models.attention import KVCache

SCALE_BYTES = 4     # a float32 scale per position and head, stored as four int8 lanes after the values
QMAX = 127          # symmetric: -128 is never used, so negating a row cannot overflow
_TINY = 1e-12       # an all-zero vector gets this scale instead of a division by zero


def quantize(x: Tensor) -> Tensor:
    """x [..., D] float -> int8 [..., D + 4]: the rounded values, then the float32 scale's bytes."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1, keepdim=True).clamp_min_(_TINY) / QMAX   # [..., 1], contiguous
    q = (x32 / scale).round_().clamp_(-QMAX, QMAX).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize(packed: Tensor, dtype: torch.dtype) -> Tensor:
    """int8 [..., D + 4] -> [..., D] in `dtype` (the products in float32, then one rounding to `dtype`)."""
    d = packed.shape[-1] - SCALE_BYTES
    scale = packed[..., d:].contiguous().view(torch.float32)               # [..., 1]
    return (packed[..., :d].float() * scale).to(dtype)


class Int8KVCache(KVCache):
    """KVCache whose per-layer tensors are int8 rows of head_dim values and a scale (see the module doc)."""

    def __init__(self, shapes: list[tuple[int, int]], device: torch.device | str, capacity: int = 256,
                 max_capacity: int | None = None):
        super().__init__(shapes, torch.int8, device, capacity, max_capacity)

    def _width(self, head_dim: int) -> int:
        return head_dim + SCALE_BYTES

    def write(self, layer: int, start: int, k: Tensor, v: Tensor) -> None:
        n = k.shape[1]
        self.k[layer][:, start:start + n] = quantize(k)
        self.v[layer][:, start:start + n] = quantize(v)

    def read(self, layer: int, end: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return dequantize(self.k[layer][:, :end], dtype), dequantize(self.v[layer][:, :end], dtype)
