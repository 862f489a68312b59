"""A KV cache preallocated once from a memory budget, handed out to requests in contiguous runs of pages.

The static-buffer step (engine/static_step.py) needs every running request's K/V in buffers whose addresses
never change, so that one captured forward can read and write any of them through index tensors. The pool is
one [kv heads, tokens, head dim] K and V tensor per layer, allocated when the engine starts (vLLM sizes its
KV cache the same way: what `gpu_memory_utilization` of the device leaves after the model, arXiv 2309.06180);
a request gets `pages` x PAGE tokens at admission and gives them back when it finishes. Its `PooledCache` is a
`KVCache` whose per-layer tensors are views of its run, so the eager path (prefill chunks, odd shapes) writes
and reads it unchanged.

Runs are contiguous, not scattered pages: the eager attention reads a request's cache as one view, and the
static step gathers [start of run + 0 .. context) per row. A request that can never fit the pool is refused
when it arrives (MemoryLimitError); one that fits but finds no free run waits in the queue until a finishing
request frees one (Scheduler.admit), instead of running out of memory mid-decode.
"""
from __future__ import annotations

import bisect

import torch

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


class PooledCache(KVCache):
    """One request's run of the pool: per-layer [kv heads, capacity, head dim] views of tokens [offset, +capacity)."""

    def __init__(self, pool: "KVPool", offset: int, capacity: int):
        self.pool, self.offset = pool, offset
        self.shapes = pool.shapes
        self.num_layers = len(pool.shapes)
        self.dtype, self.device = pool.dtype, pool.device
        self.max_capacity = capacity
        self.capacity = capacity
        self.k = [t[:, offset:offset + capacity] for t in pool.k]
        self.v = [t[:, offset:offset + capacity] for t in pool.v]
        self.length = 0

    def _grow(self, need: int) -> None:
        if need > self.capacity:  # admission sized the run for the whole canvas: this is a bug, not a full pool
            raise RuntimeError(f"a pooled KV cache of {self.capacity} tokens was asked for {need}")


class KVPool:
    """Preallocated K/V for every layer; first-fit allocation of contiguous page runs; a scratch run at the end.

    The last `scratch` tokens belong to no request: the static step's padding rows write there."""

    def __init__(self, shapes: list[tuple[int, int]], tokens: int, dtype: torch.dtype, device: torch.device | str,
                 scratch: int = 64):
        if len({s for s in shapes}) != 1:
            raise ValueError("a KV pool needs the same kv heads and head dim in every layer")
        self.shapes, self.dtype, self.device = shapes, dtype, torch.device(device)
        self.pages = max(0, tokens // PAGE)
        self.scratch = -(-scratch // PAGE) * PAGE
        self.tokens = self.pages * PAGE + self.scratch  # buffer length, scratch included
        h, d = shapes[0]
        # zeros, not empty: padding rows and masked-out reads may touch never-written slots; they must be finite
        self.k = [torch.zeros(h, self.tokens, d, dtype=dtype, device=device) for _ in shapes]
        self.v = [torch.zeros(h, self.tokens, d, dtype=dtype, device=device) for _ in shapes]
        self.free_runs: list[tuple[int, int]] = [(0, self.pages)] if self.pages else []  # (first page, pages), sorted
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
        """The longest run a request can ever get."""
        return self.pages * PAGE

    @property
    def free_tokens(self) -> int:
        return sum(n for _, n in self.free_runs) * PAGE

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def allocate(self, owner: str, tokens: int) -> PooledCache | None:
        """A run of at least `tokens` (whole pages), first fit; None when no free run is long enough now."""
        need = max(1, -(-tokens // PAGE))
        for i, (first, n) in enumerate(self.free_runs):
            if n >= need:
                if n == need:
                    del self.free_runs[i]
                else:
                    self.free_runs[i] = (first + need, n - need)
                cache = PooledCache(self, first * PAGE, need * PAGE)
                self.owned[owner] = cache
                return cache
        return None

    def release(self, owner: str) -> None:
        """Give an owner's run back (no-op for an owner without one), merging it with free neighbours."""
        cache = self.owned.pop(owner, None)
        if cache is None:
            return
        run = (cache.offset // PAGE, cache.capacity // PAGE)
        i = bisect.bisect(self.free_runs, run)
        self.free_runs.insert(i, run)
        merged: list[tuple[int, int]] = []
        for first, n in self.free_runs:
            if merged and merged[-1][0] + merged[-1][1] == first:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((first, n))
        self.free_runs = merged
