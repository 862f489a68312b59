"""A KV cache preallocated once from a memory budget, handed out to requests in pages.

The static-buffer step (engine/static_step.py) needs every running request's K/V in buffers whose addresses
never change, so that one captured forward can read and write any of them through index tensors. The pool is
one [kv heads, tokens, head dim] K and V tensor per layer, allocated when the engine starts (vLLM sizes its
KV cache the same way: what `gpu_memory_utilization` of the device leaves after the model, arXiv 2309.06180),
cut into pages of PAGE tokens. A request gets the pages its prompt + max_tokens need at admission, wherever
they are free, and gives them back when it finishes: its page table maps position p to pool token
table[p // PAGE] * PAGE + p % PAGE (vLLM's block table, the same paper), so a pool fragmented by requests of
different lengths still admits whatever fits in its free pages in all.

Its `PooledCache` is a `KVCache` that writes and reads through that table: the eager path (prefill chunks, odd
shapes) scatters a segment's K/V to its slots and gathers [0, end) back (a copy, where a contiguous cache
gives a view), and the static step looks the table up on the device for every row. A request that can never
fit the pool is refused when it arrives (MemoryLimitError); one that fits but finds too few free pages waits
in the queue until a finishing request frees them (Scheduler.admit), instead of running out of memory
mid-decode.
"""
from __future__ import annotations

import heapq

import torch
from torch import Tensor

from unmask.engine import memory
from unmask.errors import InvalidRequestError
from unmask.models.attention import KVCache

PAGE = 16  # tokens per page: the allocation unit (vLLM's default block size is 16 too)


def check_pool_options(utilization: float, tokens: int | None,
                       names: tuple[str, str] = ("memory_utilization", "kv_pool_tokens")) -> None:
    """InvalidRequestError (one line, naming the option as `names` spell it: the engine's keywords or the CLI's
    flags) for a share of free memory outside (0, 1] or an explicit pool smaller than one page."""
    if not 0 < utilization <= 1:  # written so that NaN fails too
        raise InvalidRequestError(f"{names[0]} must be in (0, 1], got {utilization}", names[0])
    if tokens is not None and tokens < PAGE:
        raise InvalidRequestError(f"{names[1]} must be at least {PAGE} (one page of the KV pool), got {tokens}",
                                  names[1])


class PagedView:
    """One layer's K or V of a paged cache, indexed like the contiguous [kv heads, positions, head dim] tensor a
    `KVCache` keeps for the code that slices it by position (the prefix cache's `cache.k[layer][:, lo:hi]`):
    reads gather, assignments scatter, through the page table."""

    def __init__(self, store: Tensor, cache: "PooledCache"):
        self.store, self.cache = store, cache

    def _slots(self, key) -> Tensor:
        if not (isinstance(key, tuple) and len(key) == 2 and key[0] == slice(None) and isinstance(key[1], slice)
                and key[1].step is None):
            raise TypeError(f"a paged KV cache is sliced as [:, lo:hi], not {key!r}")
        lo, hi, _ = key[1].indices(self.cache.capacity)
        return self.cache.slots[lo:hi]

    def __getitem__(self, key) -> Tensor:
        return self.store[:, self._slots(key)]

    def __setitem__(self, key, value) -> None:
        self.store[:, self._slots(key)] = value

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.store.shape[0], self.cache.capacity, self.store.shape[2])


class PooledCache(KVCache):
    """One request's pages of the pool: `pages` (ascending page ids), `slots` [capacity] the pool token of every
    position, on the pool's device; capacity = pages x PAGE."""

    def __init__(self, pool: "KVPool", pages: list[int]):
        self.pool, self.pages = pool, pages
        self.shapes = pool.shapes
        self.num_layers = len(pool.shapes)
        self.dtype, self.device = pool.dtype, pool.device
        self.capacity = self.max_capacity = len(pages) * PAGE
        self.table = torch.tensor(pages, dtype=torch.long)  # on the host: the static step stages it
        self.slots = (self.table[:, None] * PAGE + torch.arange(PAGE)).reshape(-1).to(pool.device)
        self.k = [PagedView(t, self) for t in pool.k]
        self.v = [PagedView(t, self) for t in pool.v]
        self.length = 0

    def write(self, layer: int, start: int, k: Tensor, v: Tensor) -> None:
        idx = self.slots[start:start + k.shape[1]]
        self.pool.k[layer][:, idx] = k.to(self.dtype)
        self.pool.v[layer][:, idx] = v.to(self.dtype)

    def read(self, layer: int, end: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        idx = self.slots[:end]
        return self.pool.k[layer][:, idx].to(dtype), self.pool.v[layer][:, idx].to(dtype)

    def nbytes(self) -> int:
        return self.capacity * self.bytes_per_token()

    def _grow(self, need: int) -> None:
        if need > self.capacity:  # admission sized the pages for the whole canvas: this is a bug, not a full pool
            raise RuntimeError(f"a pooled KV cache of {self.capacity} tokens was asked for {need}")


class KVPool:
    """Preallocated K/V for every layer in pages, handed out lowest-first; a scratch run at the end.

    The last `scratch` tokens belong to no request: the static step's padding rows write there."""

    def __init__(self, shapes: list[tuple[int, int]], tokens: int, dtype: torch.dtype, device: torch.device | str,
                 scratch: int = 64):
        if len({s for s in shapes}) != 1:
            raise ValueError("a KV pool needs the same kv heads and head dim in every layer")
        self.shapes, self.dtype, self.device = shapes, dtype, torch.device(device)
        self.pages = max(0, tokens // PAGE)
        self.scratch = -(-scratch // PAGE) * PAGE
        self.tokens = self.pages * PAGE + self.scratch  # buffer length, scratch included
        self.scratch_pages = list(range(self.pages, self.tokens // PAGE))
        h, d = shapes[0]
        # zeros, not empty: padding rows and masked-out reads may touch never-written slots; they must be finite
        self.k = [torch.zeros(h, self.tokens, d, dtype=dtype, device=device) for _ in shapes]
        self.v = [torch.zeros(h, self.tokens, d, dtype=dtype, device=device) for _ in shapes]
        self.free_pages: list[int] = list(range(self.pages))  # a heap: the lowest free pages go first
        self.owned: dict[str, PooledCache] = {}

    @classmethod
    def for_model(cls, model, max_tokens: int | None, utilization: float, dtype: torch.dtype | None,
                  scratch: int, cap: int | None = None) -> "KVPool":
        """A pool of `max_tokens` (None: what `utilization` of the memory free now allows, less the reserve that
        engine.memory keeps for activations, and at most `cap`)."""
        check_pool_options(utilization, max_tokens)
        probe = model.new_cache(capacity=0, dtype=dtype)
        if max_tokens is None:
            free = memory.available_bytes(probe.device)
            usable = max(0, int(free * utilization) - memory.RESERVED_BYTES)
            per_token = max(probe.bytes_per_token(), 1)
            max_tokens = usable // per_token
            if max_tokens < PAGE:  # refused at start, not as a MemoryLimitError on every request
                raise InvalidRequestError(
                    f"the static step's KV pool would hold no tokens at a memory utilization of {utilization} on "
                    f"{probe.device}: "
                    f"{memory.mib(free)} free, {memory.mib(memory.RESERVED_BYTES)} of it kept for activations, "
                    f"{per_token} bytes per token", "memory_utilization")
            if cap is not None:
                max_tokens = min(max_tokens, cap)
        return cls(probe.shapes, max_tokens, probe.dtype, probe.device, scratch)

    @property
    def capacity_tokens(self) -> int:
        """The most tokens a request can ever get."""
        return self.pages * PAGE

    @property
    def free_tokens(self) -> int:
        return len(self.free_pages) * PAGE

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def allocate(self, owner: str, tokens: int) -> PooledCache | None:
        """Pages for at least `tokens`, the lowest free ones wherever they are; None when too few are free now."""
        need = max(1, -(-tokens // PAGE))
        if need > len(self.free_pages):
            return None
        pages = sorted(heapq.heappop(self.free_pages) for _ in range(need))
        cache = PooledCache(self, pages)
        self.owned[owner] = cache
        return cache

    def release(self, owner: str) -> None:
        """Give an owner's pages back (no-op for an owner without any)."""
        cache = self.owned.pop(owner, None)
        if cache is None:
            return
        for page in cache.pages:
            heapq.heappush(self.free_pages, page)
