"""A CPU decode step compiled by torch.compile (inductor), one compiled forward per padded shape.

On a CPU the forward of a small model is mostly fixed cost: a few hundred small operations (norms, RoPE, slices,
residual adds) and the Python that dispatches them, around products that two cores finish quickly. Inductor
fuses the small operations into a few C++ loops and packs the linears itself (`freezing`: weights become
constants of the compiled graph), which is the CPU's counterpart of a CUDA graph: the work is fixed per shape,
so it is done once per shape (bench/compiled_step.py: 1.85x a decode step of the 5.25M model, 1.58x of the 19.9M
one, bfloat16, two cores).

A step qualifies when every request feeds one segment of at most MAX_WIDTH tokens over a plain KV cache with
room for a padded segment (the engine sizes caches so when this path is on, zeroed), with no cached suffix, on a
model of the built-in transformer without a draft adapter or experts. Each request is one row:

  * the row's tokens padded to W (a multiple of 8) with token 0 at the positions that follow;
  * its own-key mask [W, W] from the segment (block ids or the self-speculative layout: `Segment.own_mask`), a
    padding query seeing only itself; the cached prefix [0, start) is visible to every real query;
  * its K/V written into its cache at start .. start + W (the padding's past the segment: scratch the next
    step overwrites, as the eager path's own scratch), attention over the whole cache with keys at or past
    start + W, and the row's padding keys, masked;
  * the logit rows it asks for, padded to a power of two (at least 8).

The shape key is (rows, W, logit rows per row, dtype); each cache's length is a dynamic dimension of the
compiled code, so requests of any length share it. A new key compiles (5-9 s for the 5.25M model on two cores)
and later steps of that shape run the compiled code. Anything else, and a shape past `max_graphs`, runs
eagerly. Off by default (`--compile-step`, UNMASK_COMPILE_STEP=1): the first step of each new shape waits for
the compiler.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
import types

import torch
from torch import Tensor

from unmask.engine.static_step import _pow2
from unmask.models.attention import AttentionBatch, KVCache, sdpa

log = logging.getLogger("unmask.engine")

MAX_WIDTH = 64           # tokens one row may feed; wider steps (prefill chunks) run eagerly
WIDTH_STEP = 8           # rows are padded to a multiple of this (the linears pay for every padded token)
MIN_LOGIT_ROWS = 8       # logit rows per row, a power of two from here: fewer shapes, a few rows of head more
MAX_CAPACITY = 8192      # a cache past this is attended in full each step: the eager path's prefix split wins
MAX_ROWS = 8
GRAPH_WEIGHT_BUDGET = 1 << 30   # bytes of frozen weight copies the compiled graphs may hold together
_OFF = ("0", "false", "no", "off")
# half precision only: inductor packs float32 linears for MKL, whose product at these sizes is about twice the
# eager oneDNN one (runs/prof/compiled_micro2.py: the 5.25M model's compiled float32 step 0.89-0.92x eager)
COMPILED_DTYPES = (torch.bfloat16, torch.float16)
COMPILE_CONFIG = {"freezing": True, "cpp.enable_concat_linear": True}


def compile_step_requested(explicit: bool | None = None) -> bool:
    """An engine option wins; else UNMASK_COMPILE_STEP=1 turns the compiled CPU step on."""
    if explicit is not None:
        return explicit
    return os.environ.get("UNMASK_COMPILE_STEP", "0").lower() not in _OFF


def cache_capacity(total: int) -> int | None:
    """The capacity a request of `total` tokens gets when the compiled step is on: room for a padded segment past
    its last token, in whole 64s; None where the compiled step would not take it anyway."""
    cap = -(-(total + MAX_WIDTH) // 64) * 64
    return cap if cap <= MAX_CAPACITY else None


def not_compilable(model: torch.nn.Module) -> str | None:
    """Why the compiled step cannot take `model`'s forwards, or None: it traces the built-in transformer's."""
    from unmask.models.transformer import DiffusionTransformer

    if not (isinstance(model, DiffusionTransformer) and type(model)._run is DiffusionTransformer._run):
        return f"it traces the built-in transformer's forward, not {type(model).__name__}'s"
    w = model.lm_head.weight
    if w.device.type != "cpu":
        return "it is a CPU path (on a GPU the static step's CUDA graphs do this: --static-step)"
    if w.dtype not in COMPILED_DTYPES:
        return (f"{str(w.dtype).removeprefix('torch.')} weights: compiled, their products are slower than the "
                f"eager ones here (use --dtype bfloat16)")
    if model.draft_gate is not None or model.cfg.moe is not None:
        return "draft adapters and experts select rows by value, which a fixed shape cannot"
    return None


def _unguarded():
    """torch >= 2.6: skip dynamo's guard checks (~0.3 ms a call here); older builds evaluate them."""
    if hasattr(torch.compiler, "set_stance"):
        return torch.compiler.set_stance(skip_guard_eval_unsafe=True)
    return contextlib.nullcontext()


class PaddedRows:
    """The attention context of a compiled step (a transformer layer calls `attend`): R rows of W tokens, each
    over its own cache."""

    sync_free = True   # RoPE angles computed in the graph, not read from the host table

    def __init__(self, caches: list[tuple[list[Tensor], list[Tensor]]], start: Tensor, own: Tensor):
        self.caches, self.start, self.own = caches, start, own
        self.masks: list[Tensor] = []
        w = own.shape[1]
        for r, (k, _) in enumerate(caches):
            cap = k[0].shape[1]
            kpos = torch.arange(cap)
            rel = kpos[None, :] - start[r]                                            # [1, cap]
            inside = (rel >= 0) & (rel < w)
            mine = own[r].gather(1, rel.clamp(0, w - 1).expand(w, cap)) & inside      # own keys it sees
            self.masks.append((mine | (rel < 0))[None, None])                          # [1, 1, W, cap]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, layer: int) -> Tensor:
        """q [R*W, H, D], k/v [R*W, Hkv, D] -> [R*W, H, D]."""
        w = self.own.shape[1]
        outs = []
        for r, (kc, vc) in enumerate(self.caches):
            sl = slice(r * w, (r + 1) * w)
            slots = self.start[r] + torch.arange(w)
            kc[layer].index_copy_(1, slots, k[sl].transpose(0, 1))
            vc[layer].index_copy_(1, slots, v[sl].transpose(0, 1))
            o = sdpa(q[sl].transpose(0, 1), kc[layer], vc[layer], self.masks[r], None)   # grouped heads as eager
            outs.append(o.transpose(0, 1))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


class CompiledStep:
    """Compiled forwards keyed by padded shape (module docstring); `run` returns None where a step runs eagerly."""

    def __init__(self, model: torch.nn.Module, max_graphs: int | None = None):
        self.model = model
        # each compiled graph keeps its own packed copy of the weights (freezing)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.max_graphs = max_graphs or max(4, min(32, GRAPH_WEIGHT_BUDGET // max(1, weight_bytes)))
        self.dtype = model.lm_head.weight.dtype
        self.compiled: dict[tuple, object] = {}
        self.failed: set[tuple] = set()
        self.compiles = self.runs = 0
        self.compile_s = 0.0
        self.enabled = True
        self._runs: dict[tuple, int] = {}

    def _step(self, ids: Tensor, pos: Tensor, start: Tensor, own: Tensor, rows: Tensor, caches) -> Tensor:
        ctx = PaddedRows(caches, start, own)
        hidden = self.model._run(ids, pos, ctx)
        return self.model.logits(hidden.index_select(0, rows))

    def key(self, batch: AttentionBatch, counts: list[int]) -> tuple | None:
        segs = batch.segments
        if not self.enabled or not segs or len(segs) > MAX_ROWS:
            return None
        width = -(-max(s.length for s in segs) // WIDTH_STEP) * WIDTH_STEP
        if width > MAX_WIDTH:
            return None
        for s in segs:
            c = s.cache
            if (type(c) is not KVCache or c.dtype != self.dtype or s.suffix or s.extra or s.length == 0
                    or c.capacity > MAX_CAPACITY
                    or s.start + width > c.capacity or c.length > s.start + s.length):
                return None
        return (len(segs), width, _pow2(max(counts), MIN_LOGIT_ROWS), self.dtype)

    def _compiled(self, key: tuple):
        fn = self.compiled.get(key)
        if fn is None and key not in self.failed and len(self.compiled) < self.max_graphs:
            # a code object of its own per shape: dynamo keeps compiled code and its guards per code object, so
            # one shared `_step` would check every shape's guards in turn on each call (~0.4 ms at 10 shapes)
            code = CompiledStep._step.__code__.replace(co_name=f"_step_{len(self.compiled)}")
            step = types.MethodType(types.FunctionType(code, CompiledStep._step.__globals__, code.co_name), self)
            fn = torch.compile(step)
            self.compiled[key] = fn
        return fn

    def run(self, key: tuple, ids: Tensor, positions: Tensor, batch: AttentionBatch,
            rows: list[Tensor]) -> Tensor | None:
        """Logits [sum of rows, V] float32, or None: run this step eagerly. rows: per segment, its logit rows
        (offsets within the segment)."""
        fn = self._compiled(key)
        if fn is None:
            return None
        R, W, K = key[0], key[1], key[2]
        pad_ids = torch.zeros(R, W, dtype=torch.long)
        pad_pos = torch.empty(R, W, dtype=torch.long)
        own = torch.eye(W, dtype=torch.bool).repeat(R, 1, 1)   # a padding query sees itself only
        start = torch.empty(R, dtype=torch.long)
        take = torch.zeros(R, K, dtype=torch.long)
        offset = 0
        for r, (seg, sel) in enumerate(zip(batch.segments, rows)):
            n = seg.length
            pad_ids[r, :n] = ids[offset:offset + n]
            pad_pos[r, :n] = positions[offset:offset + n]
            last = int(positions[offset + n - 1])
            pad_pos[r, n:] = torch.arange(last + 1, last + 1 + W - n)
            mask = seg.own_mask(0, n)
            own[r, :n, :n] = True if mask is None else mask
            start[r] = seg.start
            take[r, :sel.numel()] = sel + r * W
            offset += n
        caches = [(seg.cache.k, seg.cache.v) for seg in batch.segments]
        first = key not in self._runs
        if first:  # each cache's length is a symbol of the compiled code, not a constant of it
            for seg in batch.segments:
                for t in seg.cache.k + seg.cache.v:
                    torch._dynamo.mark_dynamic(t, 1)
        t0 = time.perf_counter()
        args = (pad_ids.view(-1), pad_pos.view(-1), start, own, take.view(-1), caches)
        try:
            if first:  # weights become constants of the graph, packed for oneDNN; q/k/v and gate/up concatenated
                import torch._inductor.config as inductor_config
                import torch.fx.experimental._config as shape_config

                # no duck sizing: two rows whose caches are equally long now must not share one symbol, or a
                # later step with other lengths would run code that assumes them equal (guards are skipped)
                with inductor_config.patch(COMPILE_CONFIG), shape_config.patch(use_duck_shape=False):
                    logits = fn(*args)
            else:  # one compiled entry per code object and the key fixes every shape: no guards to evaluate
                with _unguarded():
                    logits = fn(*args)
        except Exception as e:  # an operation this build cannot compile: eager from now on for this shape
            self.failed.add(key)
            self.compiled.pop(key, None)
            log.warning("compiled step off for shape %s (%s)", key[:4], str(e).splitlines()[0][:200])
            return None
        if first:
            self.compiles += 1
            self.compile_s += time.perf_counter() - t0
            log.info("compiled a CPU step for %d row(s) x %d tokens (%.1f s)", R, W, time.perf_counter() - t0)
        self._runs[key] = self._runs.get(key, 0) + 1
        self.runs += 1
        if R == 1:
            return logits[:rows[0].numel()]
        return torch.cat([logits[r * K:r * K + sel.numel()] for r, sel in enumerate(rows)])
