"""Attention over a ragged batch of sequences, each with its own KV cache and mask rule.

A step feeds one flat token sequence made of per-request *segments*. Each segment's keys are
    cache[:start]  ++  this segment's own K/V  ++  cache[start+length : start+length+suffix]
and its first `write` tokens are stored in the cache at [start, start+write). `suffix` > 0 is
the dual cache of bidirectional families (cached K/V of the masked tail).

Mask rule inside a segment: query q may see key k iff block_id[k] <= block_id[q]. All tokens in
one block -> fully bidirectional; block_id = position // B -> block-causal; block_id = position
-> causal. Cached keys are always visible (they belong to earlier blocks or, for the dual cache,
to the same bidirectional canvas).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# enable_gqa arrived in torch 2.5; older builds get K/V heads repeated instead
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


class KVCache:
    """Per-request K/V for every layer, grown geometrically; positions are absolute.

    `shapes` gives each layer's (kv heads, head dim): uniform for most families, mixed where
    sliding and global layers differ (DiffusionGemma)."""

    def __init__(self, shapes: list[tuple[int, int]], dtype: torch.dtype, device: torch.device | str,
                 capacity: int = 256, max_capacity: int | None = None):
        self.shapes = shapes
        self.num_layers = len(shapes)
        self.dtype, self.device = dtype, device
        self.capacity = 0
        self.max_capacity = max_capacity  # doubling stops here (the request's prompt + max_tokens); need still wins
        self.k: list[Tensor] = [None] * len(shapes)
        self.v: list[Tensor] = [None] * len(shapes)
        self.length = 0  # tokens whose K/V are valid, from position 0
        self._grow(capacity)

    def _absolute(self, layer: int) -> bool:
        """Whether this layer stores positions [0, capacity) (a subclass may keep some layers otherwise)."""
        return True

    def _width(self, head_dim: int) -> int:
        """Stored elements per head and position (a quantised cache appends its scale)."""
        return head_dim

    def write(self, layer: int, start: int, k: Tensor, v: Tensor) -> None:
        """Store k/v [kv heads, n, head dim] at positions [start, start + n) of `layer`."""
        n = k.shape[1]
        self.k[layer][:, start:start + n] = k
        self.v[layer][:, start:start + n] = v

    def read(self, layer: int, end: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """K/V of positions [0, end) of `layer` in `dtype` (views when the cache keeps that dtype, else copies)."""
        k, v = self.k[layer][:, :end], self.v[layer][:, :end]
        if k.dtype != dtype:  # a cache kept in another dtype (--kv-cache-dtype): attend in the compute dtype
            k, v = k.to(dtype), v.to(dtype)
        return k, v

    def _grow(self, need: int) -> None:
        if need <= self.capacity:
            return
        cap = max(need, self._doubled())
        for i, (h, d) in enumerate(self.shapes):
            if not self._absolute(i):
                continue
            for store in (self.k, self.v):
                new = torch.empty(h, cap, self._width(d), dtype=self.dtype, device=self.device)
                if store[i] is not None:
                    new[:, : self.length] = store[i][:, : self.length]
                store[i] = new
        self.capacity = cap

    def _doubled(self) -> int:
        cap = max(2 * self.capacity, 64)
        return cap if self.max_capacity is None else min(cap, self.max_capacity)

    def reserve(self, end: int, start: int | None = None) -> None:
        """Room for positions up to `end`; `start` (the first position the next write touches) lets a cache that
        keeps only a window of old positions (DiffusionGemma's sliding layers) know what it may drop."""
        self._grow(end)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def bytes_per_token(self) -> int:
        """K and V of one more position over the layers that keep every position (the cache's growth rate)."""
        per = torch.empty((), dtype=self.dtype).element_size()
        return sum(2 * h * self._width(d) * per for i, (h, d) in enumerate(self.shapes) if self._absolute(i))


@dataclass
class Segment:
    start: int                      # absolute position of the segment's first token
    length: int                     # tokens fed this step
    write: int = 0                  # leading tokens whose K/V are stored in the cache
    suffix: int = 0                 # cached tokens after the segment that stay visible
    cache: KVCache | None = None
    block_ids: Tensor | None = None  # [length] long; None = all in one block (bidirectional)
    # [length, length] bool: which of the segment's own tokens each one sees, when block ids cannot say it (draft
    # blocks of a self-speculative step share positions and must not see each other); overrides block_ids
    attend: Tensor | None = None
    # with `attend`: rows [0, causal_prefix) are token-causal over the own keys and see none after them (a
    # speculative step's committed tokens and drafts), so attention may run them through the causal kernels
    causal_prefix: int = 0
    masked: bool = False             # filled by prepare(): some own key is hidden from some query (own_mask says which)
    # filled by prepare(): rows [0, causal_rows) are token-causal (block ids one per token) and the rest, if any,
    # one final group seeing every own key (a causal-context prompt chunk ending in the active block); 0 = other
    causal_rows: int = 0
    extra: dict | None = None        # family-specific per-request inputs (e.g. a decoder mode flag)

    @property
    def num_keys(self) -> int:
        return self.start + self.length + self.suffix

    def prepare(self) -> None:
        if self.cache is None and (self.start or self.suffix):
            raise ValueError("a segment that reads cached positions needs a cache")
        if self.cache is not None:
            self.cache.reserve(self.start + self.length, self.start)
            if self.start > self.cache.length and self.start > 0:
                raise ValueError(f"segment starts at {self.start} but the cache holds {self.cache.length}")
        # O(length) here: no [length, length] mask is built (1 GiB of bool at a 32K chunk); the paths that need mask
        # rows build only the rows they attend at a time (own_mask)
        self.masked, self.causal_rows = self.attend is not None, 0
        if self.attend is None and self.block_ids is not None and self.block_ids.numel():
            b = self.block_ids
            self.masked = bool(b.min() < b.max())  # every query sees every own key iff all ids are equal
            self.causal_rows = _causal_rows(b) if self.masked else 0

    def own_mask(self, lo: int, hi: int, end: int | None = None) -> Tensor | None:
        """Which of own keys [0, end) (default: all) queries [lo, hi) see, [hi - lo, end] bool; None = all."""
        if not self.masked:
            return None
        end = self.length if end is None else end
        if self.attend is not None:
            return self.attend[lo:hi, :end]
        b = self.block_ids
        return b[None, :end] <= b[lo:hi, None]

    def mask_rows(self, lo: int, hi: int) -> Tensor | None:
        """Mask rows [lo, hi) over all keys (cached prefix and suffix are always visible)."""
        own = self.own_mask(lo, hi)
        if own is None:
            return None
        n, dev = hi - lo, own.device
        return torch.cat([torch.ones(n, self.start, dtype=torch.bool, device=dev), own,
                          torch.ones(n, self.suffix, dtype=torch.bool, device=dev)], dim=1)


def _causal_rows(b: Tensor) -> int:
    """c such that block ids b[:c] step by one and b[c:] is one group starting one past b[c - 1] (c = len(b) when
    the last group is a single token: all causal); 0 when the ids are not of that form."""
    n = b.numel()
    c = int(torch.searchsorted(b, b[-1:]))  # first row of the final group (ids never decrease along a segment)
    if (c == 0 or int(b[c] - b[c - 1]) != 1 or not bool((b[1:c] - b[:c - 1] == 1).all())
            or not bool((b[c:] == b[-1]).all())):
        return 0
    return n if c == n - 1 else c


@dataclass
class AttentionBatch:
    """Everything attention needs for one forward over a flat token sequence."""

    segments: list[Segment]

    def prepare(self) -> "AttentionBatch":
        for s in self.segments:
            s.prepare()
        return self

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.segments)


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None) -> Tensor:
    """q [H, Lq, D], k/v [Hkv, Lk, D] -> [H, Lq, Dv]; grouped-query heads share K/V.

    Called with a leading batch dimension: on CPU, 3-D inputs with a mask take SDPA's math path
    (scores materialised), 4-D inputs its flash kernel (measured at Lq 2K, Lk 8K, 8 heads:
    1.2 GB and 1.58 s vs 63 MB and 0.37 s)."""
    hq, hk = q.shape[0], k.shape[0]
    if hq != hk and not _SDPA_HAS_GQA:
        k = k.repeat_interleave(hq // hk, dim=0)
        v = v.repeat_interleave(hq // hk, dim=0)
    kwargs = {"enable_gqa": True} if hq != hk and _SDPA_HAS_GQA else {}
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale, **kwargs)[0]


# SDPA's CPU flash kernel materialises a boolean mask as a float [Lq, Lk] tensor: cap it at 128 MB by
# splitting queries, so a long prompt's chunked prefill stays linear in context length.
MAX_MASK_ELEMENTS = 1 << 25


# CPU flash attention that also returns each row's log-sum-exp, so attention over two key sets can be
# computed apart and merged exactly (torch >= 2.3; older builds keep the single masked call).
def _cpu_flash_op():
    try:
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    except (AttributeError, RuntimeError):
        return None
    return op if "attn_mask" in str(op._schema) else None


_CPU_FLASH = _cpu_flash_op()

# A masked segment over a long cached prefix is split (prefix unmasked + own keys masked) once the
# prefix-by-query area reaches this: below it the extra call and the merge cost more than the mask.
SPLIT_MIN_ELEMENTS = 1 << 20


# Query rows per call over a segment's own keys in the split path: small enough that each call skips the
# keys its rows' blocks cannot see yet, large enough to keep the call count low.
OWN_ROWS = 512


def repeat_kv(t: Tensor, groups: int) -> Tensor:
    """K/V heads repeated for grouped-query attention, in the order SDPA's enable_gqa uses."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=0)


def _flash_lse(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None,
               causal: bool = False) -> tuple[Tensor, Tensor]:
    """q [H, Lq, D], k/v [H, Lk, D], mask bool [Lq, Lk] or None -> out [H, Lq, D], lse [H, Lq] (float32)."""
    add = None
    if mask is not None:  # the kernel takes an additive mask of the query's dtype
        add = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    out, lse = _CPU_FLASH(q[None], k[None], v[None], 0.0, causal, attn_mask=add, scale=scale)
    return out[0], lse[0]


def _flash_lse_shared(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> tuple[Tensor, Tensor]:
    """_flash_lse without a mask for grouped-query heads, with no copy of K/V: the query heads that share a KV
    head are stacked along the query axis ([Hkv, groups x Lq, D]; without a mask every query row is independent),
    so a long cached prefix is read once per KV head instead of being repeated to the query heads."""
    h, lq, d = q.shape
    hk = k.shape[0]
    if h == hk:
        return _flash_lse(q, k, v, None, scale)
    out, lse = _flash_lse(q.reshape(hk, h // hk * lq, d), k, v, None, scale)  # head i reads KV head i // groups
    return out.reshape(h, lq, out.shape[-1]), lse.reshape(h, lq)


def _merge_lse(oa: Tensor, la: Tensor, ob: Tensor, lb: Tensor, dtype: torch.dtype) -> Tensor:
    """Softmax attention over key sets A ++ B from each set's output and log-sum-exp."""
    m = torch.maximum(la, lb)
    wa, wb = (la - m).exp_(), (lb - m).exp_()
    return ((oa.float() * wa[..., None] + ob.float() * wb[..., None]) / (wa + wb)[..., None]).to(dtype)


def can_split_on(q: Tensor) -> bool:
    """Whether the log-sum-exp split paths run for these queries (CPU flash kernel, float32 or bfloat16)."""
    return _CPU_FLASH is not None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)


def attend_prefix_causal(q: Tensor, k: Tensor, v: Tensor, start: int, scale: float | None) -> Tensor:
    """Queries at positions start.. over keys 0.. (k/v cover [0, start + Lq)): the prefix [0, start) is seen
    whole, the queries' own keys causally; two flash calls with no mask, merged by log-sum-exp."""
    groups = q.shape[0] // k.shape[0]
    oa, la = _flash_lse_shared(q, k[:, :start], v[:, :start], scale)
    ob, lb = _flash_lse(q, repeat_kv(k[:, start:], groups), repeat_kv(v[:, start:], groups), None, scale,
                        causal=True)
    return _merge_lse(oa, la, ob, lb, q.dtype)


def _attend_split(q: Tensor, k: Tensor, v: Tensor, seg: Segment, scale: float | None) -> Tensor:
    """A masked segment after a cached prefix. Every query sees the whole prefix, so the prefix is attended
    in one call without a mask and only the segment's own keys carry one; own-key calls take OWN_ROWS query
    rows and read own keys only up to the last one those rows' blocks allow (block ids never decrease
    along a segment). The two softmaxes merge exactly through their log-sum-exps. Equal to the single
    masked call up to float rounding (tested). The prefix call makes no copy of the cached K/V
    (_flash_lse_shared)."""
    start, lq, groups = seg.start, q.shape[1], q.shape[0] // k.shape[0]
    oa, la = _flash_lse_shared(q, k[:, :start], v[:, :start], scale)
    ko, vo = repeat_kv(k[:, start:start + lq], groups), repeat_kv(v[:, start:start + lq], groups)
    ends = torch.searchsorted(seg.block_ids, seg.block_ids, right=True).tolist()  # own keys each row sees
    obs, lbs = [], []
    for i in range(0, lq, OWN_ROWS):
        j = min(i + OWN_ROWS, lq)
        e = ends[j - 1]
        ob, lb = _flash_lse(q[:, i:j], ko[:, :e], vo[:, :e], seg.own_mask(i, j, e), scale)
        obs.append(ob)
        lbs.append(lb)
    ob, lb = (obs[0], lbs[0]) if len(obs) == 1 else (torch.cat(obs, dim=1), torch.cat(lbs, dim=1))
    return _merge_lse(oa, la, ob, lb, q.dtype)


def _sdpa_causal(q: Tensor, k: Tensor, v: Tensor, scale: float | None) -> Tensor:
    """q [H, L, D] over its own keys k/v [Hkv, L, D], token-causal (the kernel's top-left rule)."""
    groups = q.shape[0] // k.shape[0]
    kwargs = {"enable_gqa": True} if groups > 1 and _SDPA_HAS_GQA else {}
    if groups > 1 and not kwargs:
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale, **kwargs)[0]


def _attend_causal(q: Tensor, k: Tensor, v: Tensor, seg: Segment, scale: float | None, c: int,
                   rest: Tensor | None = None) -> Tensor | None:
    """Rows [0, c) token-causal over their own keys (and the cached prefix) through the kernels' own causal rule,
    which skips the upper triangle instead of reading a materialised [Lq, Lk] mask; the rows after them in one call
    over every key, masked by `rest` (their mask rows; None: they see every key, a causal-context prompt chunk's
    final group). None where no such calls fit (a cached prefix off the CPU flash kernel): the masked paths run."""
    n, start = q.shape[1], seg.start
    if start and not can_split_on(q):
        return None
    parts = []
    if c:
        if start:
            parts.append(attend_prefix_causal(q[:, :c], k[:, :start + c], v[:, :start + c], start, scale))
        else:
            parts.append(_sdpa_causal(q[:, :c], k[:, :c], v[:, :c], scale))
    if c < n:
        parts.append(sdpa(q[:, c:], k, v, rest, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


# rows a causal prefix of an explicitly masked segment must have before they take the causal kernels apart from
# the rest: a decoding step's few rows keep the one masked call (no second call per layer; not measured apart)
CAUSAL_PREFIX_MIN_ROWS = 64


def _attend_causal_prefix(q: Tensor, k: Tensor, v: Tensor, seg: Segment, scale: float | None) -> Tensor | None:
    """A segment with an explicit mask whose first rows are token-causal (seg.causal_prefix: a speculative step
    carrying a prompt's last chunk): those rows through the causal path, the rest (draft blocks, a few rows) masked
    over every key. None where the split does not run."""
    c, n = seg.causal_prefix, q.shape[1]
    if c < CAUSAL_PREFIX_MIN_ROWS or seg.suffix:
        return None
    return _attend_causal(q, k, v, seg, scale, c, seg.mask_rows(c, n) if c < n else None)


def _attend_chunked(q: Tensor, k: Tensor, v: Tensor, seg: Segment, scale: float | None) -> Tensor:
    lq, lk = q.shape[1], k.shape[1]
    if seg.causal_rows and seg.attend is None and not seg.suffix:
        out = _attend_causal(q, k, v, seg, scale, seg.causal_rows)
        if out is not None:
            return out
    if seg.causal_prefix and seg.attend is not None:
        out = _attend_causal_prefix(q, k, v, seg, scale)
        if out is not None:
            return out
    if (seg.masked and seg.attend is None and can_split_on(q) and not seg.suffix and seg.start > 0
            and seg.start * lq >= SPLIT_MIN_ELEMENTS):
        return _attend_split(q, k, v, seg, scale)
    if not seg.masked or lq * lk <= MAX_MASK_ELEMENTS:
        return sdpa(q, k, v, seg.mask_rows(0, lq), scale)
    step = max(1, MAX_MASK_ELEMENTS // lk)
    return torch.cat([sdpa(q[:, i:i + step], k, v, seg.mask_rows(i, min(i + step, lq)), scale)
                      for i in range(0, lq, step)], dim=1)


def ragged_attention(q: Tensor, k: Tensor, v: Tensor, batch: AttentionBatch, layer: int,
                     scale: float | None = None) -> Tensor:
    """q [N, H, D], k/v [N, Hkv, D] (flat over segments) -> [N, H, Dv]."""
    outs = []
    offset = 0
    for seg in batch.segments:
        sl = slice(offset, offset + seg.length)
        offset += seg.length
        qs = q[sl].transpose(0, 1)
        ks, vs = k[sl].transpose(0, 1), v[sl].transpose(0, 1)
        cache = seg.cache
        if cache is not None:
            # write this segment's K/V in place and attend to the cache view: no per-layer concat.
            # Positions past `write` are scratch that the next step overwrites; for the dual cache
            # they replace the active block's stale K/V, as Fast-dLLM's replace_position does.
            cache.write(layer, seg.start, ks, vs)
            ks, vs = cache.read(layer, seg.num_keys, qs.dtype)
        outs.append(_attend_chunked(qs, ks, vs, seg, scale).transpose(0, 1))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def commit_cache_lengths(batch: AttentionBatch) -> None:
    """After a forward: the cache now holds everything up to each segment's last written token."""
    for seg in batch.segments:
        if seg.cache is not None and seg.write:
            seg.cache.length = seg.start + seg.write
