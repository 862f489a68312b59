"""Will a request's KV cache fit in memory? Checked when a request arrives, so a prompt too long for the memory
left is refused with the number of tokens that would fit instead of crashing the process mid-prefill.

A request's cache holds K and V of every layer for every position of prompt + max_tokens:
layers x kv heads x head dim x 2 x bytes of the cache dtype per token (KVCache.bytes_per_token), and while a
layer attends over a cache kept in another dtype, a copy of its K/V in the compute dtype (read_copy_per_token).
Both are compared with the memory free now (CUDA: torch.cuda.mem_get_info; CPU: MemAvailable of /proc/meminfo,
else psutil) less a safety margin for what does not grow with the context: prefill activations, allocator slack,
other requests growing their caches."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from unmask.errors import InvalidRequestError

USABLE_SHARE = 0.8            # of the memory free now, what one request's cache may take
RESERVED_BYTES = 256 << 20    # kept back on top: a prefill chunk's activations and the attention scratch


def available_bytes(device: torch.device | str) -> int:
    """Bytes free now on `device` (an input of the check: tests set it through monkeypatch)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return int(psutil.virtual_memory().available)


def read_copy_per_token(shapes: list[tuple[int, int]], cache_dtype: torch.dtype, compute_dtype: torch.dtype) -> int:
    """Transient bytes per context token while one layer attends over a cache kept in another dtype than the
    compute's: that layer's K and V read back as a cast (bfloat16) or dequantised (int8) copy, which grows with
    the context as the cache does. One layer at a time, so the largest layer counts; 0 when the dtypes agree.
    (Grouped-query heads add no copy: SDPA's enable_gqa and the split path's prefix call read K/V as stored.)"""
    if cache_dtype == compute_dtype:
        return 0
    size = torch.empty((), dtype=compute_dtype).element_size()
    return max((2 * h * d * size for h, d in shapes), default=0)


@dataclass(frozen=True)
class MemoryBudget:
    bytes_per_token: int   # K/V of a position over the layers that keep all positions + one layer's read copy
    available: int         # bytes free when read
    usable: int            # what a request's cache may take: available x USABLE_SHARE - RESERVED_BYTES

    @property
    def tokens(self) -> int:
        return max(0, self.usable // max(self.bytes_per_token, 1))


def budget(bytes_per_token: int, device: torch.device | str) -> MemoryBudget:
    free = available_bytes(device)
    return MemoryBudget(bytes_per_token, free, max(0, int(free * USABLE_SHARE) - RESERVED_BYTES))


def mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


KV_CACHE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "int8": torch.int8}  # int8: Int8KVCache


def resolve_kv_cache_dtype(name: str | None) -> torch.dtype | None:
    """--kv-cache-dtype -> the cache's dtype; None for auto (the weights' dtype)."""
    if name in (None, "auto"):
        return None
    if name not in KV_CACHE_DTYPES:
        raise InvalidRequestError(f"unknown KV cache dtype {name!r}; choose one of auto, {', '.join(KV_CACHE_DTYPES)}",
                                  "kv_cache_dtype")
    return KV_CACHE_DTYPES[name]
