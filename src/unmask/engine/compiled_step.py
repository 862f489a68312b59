"""A CPU decode step compiled by torch.compile (inductor), one compiled forward per count of rows.

On a CPU the forward of a small model is mostly fixed cost: a few hundred small operations (norms, RoPE, slices,
residual adds) and the Python that dispatches them, around products that two cores finish quickly. Inductor
fuses the small operations into a few C++ loops and packs the linears itself (`freezing`: weights become
constants of the compiled graph), which is the CPU's counterpart of a CUDA graph: the work is fixed per shape,
so it is done once (bench/compiled_step.py: 1.99x a decode step of the 5.25M drafter, 1.36x of the 19.9M model,
bfloat16, two cores).

A step qualifies when every request feeds one segment of at most MAX_WIDTH tokens (MAX_WIDTH_ALONE when it is the
only request: a prompt's first forward, up to 512 tokens, runs compiled too) over a plain KV cache with
room for a padded segment (the engine sizes caches so when this path is on, zeroed), with no cached suffix, on a
model of the built-in transformer without a draft adapter or experts. Each request is one row:

  * the row's tokens padded to W (a multiple of 8, the longest segment's) with token 0 at the positions after;
  * its own-key mask [W, W] from the segment (block ids or the self-speculative layout: `Segment.own_mask`), a
    padding query seeing only itself; the cached prefix [0, start) is visible to every real query;
  * its K/V written into its cache at start .. start + W (the padding's past the segment: scratch the next
    step overwrites, as the eager path's own scratch), attention over the whole cache with keys at or past
    start + W, and the row's padding keys, masked;
  * the logit rows it asks for, padded to K (a multiple of 8).

Rows are padded to a power of two (1, 2, 4, 8) with rows of token 0 over scratch caches of their own, whose
logits are dropped. W, K and each cache's length are dynamic dimensions of the compiled code (symbols, not
constants: `torch._dynamo.mark_dynamic`, no duck sizing), so one compiled forward per row count serves every
step of that many rows: 4 compiles at most per process (about 25 s each for these models on two cores with an
empty inductor cache, 12 s with a warm one). A step of a row count not compiled yet compiles before it runs
(the engine compiles one row at start: `warm`); anything else runs eagerly, as do row counts past the
weight-copy budget (each compiled forward holds its own packed copy of the weights: at most 1 GiB of copies).
`--compile-step` (UNMASK_COMPILE_STEP=1) compiles every row count so; `unmask serve`'s default (AUTO) compiles
the one-request forward at start where the model qualifies and runs steps of several requests eagerly, so no
request waits for a compile (a first burst would otherwise wait ~25 s once per row count on two cores).
`unmask generate` and the library default to off: a one-shot answer would pay the compile for one request.
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

MAX_WIDTH = 64           # tokens each row of a several-request step may feed (all rows pad to the widest)
# tokens a request alone may feed: its prompt's forward too, up to here (bench/compiled_first_forward.py: time to
# first token 1.15x eager's on the 19.9M model, 0.95x on the 5.25M one); wider prompts' chunks run eagerly
MAX_WIDTH_ALONE = 512
WIDTH_STEP = 8           # rows' tokens and logit rows are padded to a multiple of this: never a size of 1, which
                         # the compiler would specialise (the traced code assumes the symbols it saw stay > 1)
MAX_CAPACITY = 8192      # a cache past this is attended in full each step: the eager path's prefix split wins
MAX_ROWS = 8
WARM_CAPACITY = 512      # the cache length `warm` traces with (the code is tuned for its sizes)
GRAPH_WEIGHT_BUDGET = 1 << 30   # bytes of frozen weight copies the compiled forwards may hold together
_OFF = ("0", "false", "no", "off")
# half precision only: inductor packs float32 linears for MKL, whose product at these sizes is about twice the
# eager oneDNN one (runs/prof/compiled_micro2.py: the 5.25M model's compiled float32 step 0.89-0.92x eager)
COMPILED_DTYPES = (torch.bfloat16, torch.float16)
COMPILE_CONFIG = {"freezing": True, "cpp.enable_concat_linear": True}


AUTO = "auto"   # the one-request forward only, where the model qualifies (silently eager where it does not)


def compile_step_requested(explicit: bool | str | None = None) -> bool | str:
    """True (every row count), AUTO or False: an engine option wins; else UNMASK_COMPILE_STEP (1 / auto / 0)."""
    if explicit is not None:
        return explicit
    raw = os.environ.get("UNMASK_COMPILE_STEP", "0").strip().lower()
    return AUTO if raw == AUTO else raw not in _OFF


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
    """Compiled forwards keyed by row count (module docstring); `run` returns None where a step runs eagerly."""

    def __init__(self, model: torch.nn.Module, compile_when_met: bool = True):
        self.model = model
        self.compile_when_met = compile_when_met   # False: only what `warm` compiled runs compiled
        self.dtype = model.lm_head.weight.dtype
        # each compiled forward keeps its own packed copy of the weights (freezing): at most GRAPH_WEIGHT_BUDGET
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.max_graphs = max(1, min(4, GRAPH_WEIGHT_BUDGET // max(1, weight_bytes)))
        self.compiled: dict[int, object] = {}     # padded row count -> its compiled function (traced: ready)
        self.failed: set[int] = set()
        self.compiles = self.runs = 0
        self.compile_s = 0.0
        self.enabled = True
        self._scratch: list[tuple[list[Tensor], list[Tensor]]] = []   # caches of padding rows

    def _step(self, ids: Tensor, pos: Tensor, start: Tensor, own: Tensor, rows: Tensor, caches) -> Tensor:
        ctx = PaddedRows(caches, start, own)
        hidden = self.model._run(ids, pos, ctx)
        return self.model.logits(hidden.index_select(0, rows))

    def key(self, batch: AttentionBatch, counts: list[int]) -> tuple | None:
        """(rows, W, K): the padded shape of this step, or None where it runs eagerly."""
        segs = batch.segments
        if not self.enabled or not segs or len(segs) > MAX_ROWS:
            return None
        width = _round_up(max(s.length for s in segs))
        if width > (MAX_WIDTH if len(segs) > 1 else MAX_WIDTH_ALONE):
            return None
        for s in segs:
            c = s.cache
            if (type(c) is not KVCache or c.dtype != self.dtype or s.suffix or s.extra or s.length == 0
                    or c.capacity > MAX_CAPACITY
                    or s.start + width > c.capacity or c.length > s.start + s.length):
                return None
        return (_pow2(len(segs), 1), width, _round_up(max(1, *counts)))   # a write-only chunk asks for no rows

    def _zero_cache(self, capacity: int) -> tuple[list[Tensor], list[Tensor]]:
        c = self.model.new_cache(capacity=capacity, max_capacity=capacity)
        for t in c.k + c.v:
            t.zero_()
        return c.k, c.v

    def _scratch_cache(self, i: int) -> tuple[list[Tensor], list[Tensor]]:
        """The cache of padding row i: its K/V are scratch, read by that row alone."""
        while len(self._scratch) <= i:
            self._scratch.append(self._zero_cache(2 * MAX_WIDTH))
        return self._scratch[i]

    def _inputs(self, key: tuple, batch: AttentionBatch | None, ids: Tensor | None, positions: Tensor | None,
                rows: list[Tensor], capacity: int = 0) -> tuple:
        """The padded arguments of the compiled function; batch None: every row a padding row over a fresh cache
        of `capacity` (a trace's inputs)."""
        R, W, K = key
        pad_ids = torch.zeros(R, W, dtype=torch.long)
        pad_pos = torch.arange(W).repeat(R, 1)
        own = torch.eye(W, dtype=torch.bool).repeat(R, 1, 1)   # a padding query sees itself only
        start = torch.zeros(R, dtype=torch.long)
        take = (torch.arange(R) * W)[:, None].repeat(1, K)
        segs = batch.segments if batch is not None else []
        offset = 0
        for r, (seg, sel) in enumerate(zip(segs, rows)):
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
        if batch is None:
            caches = [self._zero_cache(capacity) for _ in range(R)]
        else:   # padding rows: a scratch cache each (distinct tensors: the compiled code writes every row's cache)
            caches = [(seg.cache.k, seg.cache.v) for seg in segs]
            caches += [self._scratch_cache(i) for i in range(R - len(segs))]
        return pad_ids.view(-1), pad_pos.view(-1), start, own, take.view(-1), caches

    def _trace(self, fn, args: tuple) -> Tensor:
        """The first call of `fn`: dynamo traces it, inductor compiles it with frozen, oneDNN-packed weights and
        concatenated q/k/v and gate/up. The widths and each cache's length become symbols of the code."""
        import torch._inductor.config as inductor_config
        import torch.fx.experimental._config as shape_config

        ids, pos, _, own, take, caches = args
        for t in (ids, pos, take):
            torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(own, 1)
        torch._dynamo.mark_dynamic(own, 2)
        for kc, vc in caches:
            for t in kc + vc:
                torch._dynamo.mark_dynamic(t, 1)
        # no duck sizing: sizes equal in this call (two caches, W and K) must not share one symbol, or a later
        # step where they differ would run code that assumes them equal (guards are skipped)
        with inductor_config.patch(COMPILE_CONFIG), shape_config.patch(use_duck_shape=False), torch.no_grad():
            return fn(*args)   # no_grad: an inference graph (freezing needs one), and grad mode is guarded

    def warm(self, rows: int = 1) -> bool:
        """Compile the forward of `rows` rows now, on padding rows (a server does this before it takes requests);
        False where it could not (those steps stay eager)."""
        if rows in self.compiled:
            return True
        if not self._may_compile(rows):
            return False
        # hints the compiler tunes for: a mid-size step over a cache of a typical prompt
        args = self._inputs((rows, 2 * WIDTH_STEP, WIDTH_STEP), None, None, None, [], capacity=WARM_CAPACITY)
        return self._compile(rows, args) is not None

    def _compile(self, rows: int, args: tuple) -> Tensor | None:
        """Compile the forward of `rows` rows by its first call, on `args`: its logits, or None (eager)."""
        if not self._may_compile(rows):
            return None
        # a code object of its own per row count: dynamo keeps compiled code and its guards per code object, so
        # one shared `_step` would check every count's guards in turn on each call
        code = CompiledStep._step.__code__.replace(co_name=f"_step_{rows}")
        fn = torch.compile(types.MethodType(types.FunctionType(code, CompiledStep._step.__globals__, code.co_name),
                                            self))
        t0 = time.perf_counter()
        try:
            out = self._trace(fn, args)
        except Exception as e:  # an operation this build cannot compile
            return self._give_up(rows, e)
        self.compiled[rows] = fn
        self.compiles += 1
        self.compile_s += time.perf_counter() - t0
        log.info("compiled the CPU step for %d row(s) (%.1f s)", rows, time.perf_counter() - t0)
        return out

    def _may_compile(self, rows: int) -> bool:
        return rows not in self.failed and len(self.compiled) < self.max_graphs

    def _give_up(self, rows: int, error: Exception) -> None:
        """Steps of `rows` rows run eagerly from now on (this one included: the caller runs it)."""
        self.failed.add(rows)
        self.compiled.pop(rows, None)
        log.warning("compiled step off for %d row(s) (%s)", rows, str(error).splitlines()[0][:200])

    def run(self, key: tuple, ids: Tensor, positions: Tensor, batch: AttentionBatch,
            rows: list[Tensor]) -> Tensor | None:
        """Logits [sum of rows, V] float32, or None: run this step eagerly. rows: per segment, its logit rows
        (offsets within the segment)."""
        fn = self.compiled.get(key[0])
        if fn is None and not (self.compile_when_met and self._may_compile(key[0])):
            return None
        args = self._inputs(key, batch, ids, positions, rows)
        if fn is None:
            logits = self._compile(key[0], args)
            if logits is None:
                return None
        else:
            try:  # one compiled entry per code object, and its shapes are symbols: no guards to evaluate
                with _unguarded(), torch.no_grad():
                    logits = fn(*args)
            except Exception as e:
                return self._give_up(key[0], e)
        self.runs += 1
        K = key[2]
        if len(rows) == 1:
            return logits[:rows[0].numel()]
        return torch.cat([logits[r * K:r * K + sel.numel()] for r, sel in enumerate(rows)])


def _round_up(n: int) -> int:
    return -(-n // WIDTH_STEP) * WIDTH_STEP
