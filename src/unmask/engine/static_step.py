"""The static-buffer decode step of the block-causal families, captured as a CUDA graph per shape on a GPU.

A block-causal step feeds each request a short segment (the active block, and at a block's first step the
finished block before it, whose K/V it writes). On a GPU such a step of a 1.7B model is a few hundred small
kernels whose launches cost more than their work (issue 31: about 33 us each on an H200), so the step runs
on fixed buffers instead, and the whole forward is replayed from a CUDA graph:

  * rows: one per request, the batch padded to a bucket of 1, 2, 4, 8, ... rows (vLLM captures a fixed list
    of batch sizes the same way, padding a step up to the next one); width W: the longest segment rounded up
    to a power of two; context: the farthest key any row reads, rounded up likewise; K: the most rows one
    request reads logits from (its masked positions), rounded up likewise. One graph per (rows, W, context,
    K, whether a row samples), captured the first time that shape runs (warm-up on a side stream with
    synchronising ops refused, as engine/graphs.py does), replayed after.
  * inputs: token ids, positions, block ids, each row's cache start, its page table (the pool page of each of
    its positions up to the context), the K rows it reads, its commit rule and sampling settings, in one long
    tensor and one float tensor per shape (engine/static_inputs.py); the pool slots each token writes and each
    key is read from are looked up in the tables inside the graph. The step itself writes the next step's
    inputs at its end (the committed tokens into each row's canvas, the read rows still masked, the counters),
    so the host stages only the rows whose next plan differs from that (a new request, a block's first step,
    a commit the host made otherwise): one copy of those rows, none on a step inside every row's block.
  * padding cannot reach real rows: a padding token has block id PAD_BLOCK, above every real one, so no real
    query sees it (`block_id[k] <= block_id[q]`); a real row's padding tokens write K/V past its segment, at
    positions the next step overwrites before anything reads them (the eager path's scratch rule); padding
    rows read and write the pool's scratch pages, which belong to no request. Rows never mix: norms, linears
    and the MLP act per token and attention per row.
  * the KV cache is the preallocated, paged pool (engine/kv_pool.py); attention gathers each row's keys
    [0, context) through its page table and masks them (the cached prefix whole, the row's own tokens by
    block id), so no dense T x T mask over the whole sequence exists, only [rows, W, context].
  * decoding on the device: the output head (over the K read rows of each row only: a block's committed half
    and the finished block it carries need none), the mask-token ban, the greedy proposal (argmax, p(x0),
    p1 - p2, log p(x0); `decoding.sampling.propose`, the same function the host runs), for requests that
    sample (with device sampling: on by default where the step is captured, UNMASK_DEVICE_SAMPLING) a draw
    under their temperature, top-k and top-p from a counter-based generator keyed by the request's seed
    (`decoding.device_sample`), and for threshold and topk requests the commit rule (`decoding.device_select`,
    the batched form of `decoding.policies`' rules, with the block's forced first token) run inside the graph;
    one copy of [5, rows x K] numbers (tokens, confidences, commit flags) to the host is the step's only
    synchronisation, and it carries the events the server streams. The host then writes the committed tokens
    into its canvas; requests under another rule run it there over their M proposals. Requests that adjust
    logits or record top alternatives (and sampled ones without device sampling) get their rows' logits
    instead (projected from the graph's hidden states: a second copy).

Off the GPU, or with UNMASK_CUDA_GRAPHS=0, the same buffers and the same forward run without capture, which
is how the CPU suite tests this path (tests/test_static_step.py: tokens identical to the eager path).
Everything else (long prefill chunks, speculative and infill requests, bidirectional families, a request
without a pooled cache) runs eagerly through engine/runner.py.
"""
from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from unmask.decoding.device_sample import sample_rows, uniforms
from unmask.decoding.device_select import HOST, DeviceDecision, commit_rows
from unmask.decoding.sampling import Proposal, SamplingParams, propose
from unmask.engine.graphs import graphs_requested
from unmask.engine.kv_pool import PAGE, KVPool, PooledCache
from unmask.engine.sequence import Sequence, StepPlan
from unmask.engine.static_inputs import (PADDING, Resident, RowRule, advance_on_device, cache_of, columns,
                                         fill_rows, row_rule, stage_width)
from unmask.errors import InvalidRequestError
from unmask.models.attention import _SDPA_HAS_GQA, repeat_kv

log = logging.getLogger("unmask.engine")

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_WIDTH = 64          # tokens one row may feed; wider steps (prefill chunks) run eagerly
MIN_CONTEXT = 128       # smallest context bucket: short prompts share one graph per (rows, width, K)
_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def static_step_requested(explicit: bool | None) -> bool:
    """An engine option wins; else UNMASK_STATIC_STEP=1 turns the static step on (off by default until the GPU
    check has run it: issue 31)."""
    if explicit is not None:
        return explicit
    return os.environ.get("UNMASK_STATIC_STEP", "0").lower() not in _OFF


def cuda_graphs_on(device: torch.device, explicit: bool | None = None) -> bool:
    return device.type == "cuda" and graphs_requested(explicit)


def _pow2(n: int, lo: int) -> int:
    return max(lo, 1 << max(0, n - 1).bit_length())


class StaticBatch:
    """The attention context of a static step (a transformer layer calls `attend`): rows of W tokens, each
    row's K/V in its pages of the pool."""

    sync_free = True  # layers take their variant that reads nothing back to the host (the MoE's expert loop)

    def __init__(self, pool: KVPool, ids: Tensor, bids: Tensor, start: Tensor, table: Tensor, context: int):
        """table [rows, context / PAGE]: the pool page of each row's positions (kv_pool's block table)."""
        self.pool, self.ids, self.bids, self.start, self.table = pool, ids, bids, start, table
        self.context = context
        self.read_idx = self.write_idx = self.mask = None

    def _slots(self, pos: Tensor) -> Tensor:
        """Pool token of each row's positions `pos` [rows, n] (or [1, n], the same for every row)."""
        return self.table.gather(1, (pos // PAGE).expand(self.table.shape[0], -1)) * PAGE + pos % PAGE

    def prepare(self) -> None:
        """Slots and mask from the input buffers (inside the captured forward: replays recompute them)."""
        w = self.ids.shape[1]
        kpos = torch.arange(self.context, device=self.ids.device)
        self.read_idx = self._slots(kpos[None, :])                                          # [rows, context]
        self.write_idx = self._slots(self.start[:, None] + kpos[None, :w])                  # [rows, W]
        rel = kpos[None, :] - self.start[:, None]                                           # key - segment start
        own = (rel >= 0) & (rel < w)
        key_block = self.bids.gather(1, rel.clamp(0, w - 1))                                # [rows, context]
        seen = own[:, None, :] & (key_block[:, None, :] <= self.bids[:, :, None])
        self.mask = ((rel < 0)[:, None, :] | seen)[:, None]                                 # [rows, 1, W, context]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, layer: int) -> Tensor:
        """q [rows, W, H, D], k/v [rows, W, Hkv, D] -> [rows, W, H, D]; writes k/v to the pool first."""
        pk, pv = self.pool.k[layer], self.pool.v[layer]                     # [Hkv, pool tokens, D]
        pk[:, self.write_idx] = k.permute(2, 0, 1, 3).to(pk.dtype)
        pv[:, self.write_idx] = v.permute(2, 0, 1, 3).to(pv.dtype)
        keys = pk[:, self.read_idx].transpose(0, 1).to(q.dtype)             # [rows, Hkv, context, D]
        vals = pv[:, self.read_idx].transpose(0, 1).to(q.dtype)
        qh = q.transpose(1, 2)
        hq, hk = qh.shape[1], keys.shape[1]
        kwargs = {}
        if hq != hk:
            if _SDPA_HAS_GQA:
                kwargs["enable_gqa"] = True
            else:
                keys = repeat_kv(keys.transpose(0, 1), hq // hk).transpose(0, 1)
                vals = repeat_kv(vals.transpose(0, 1), hq // hk).transpose(0, 1)
        return F.scaled_dot_product_attention(qh, keys, vals, attn_mask=self.mask, **kwargs).transpose(1, 2)


@dataclass
class _Shape:
    stage: Tensor      # host [rows, stage_width] long (static_inputs.Columns)
    floats: Tensor     # host [rows, 3] float32: each row's threshold, temperature, top-p
    inputs: Tensor     # the stage on the device (advanced by each step: static_inputs.advance_on_device)
    dfloats: Tensor    # the floats on the device
    hidden: Tensor | None  # [rows x K, D]: final hidden states of the read rows (for logits the host needs)
    packed: Tensor | None  # [5, rows x K] float64: proposed token, p(x0), p1 - p2, log p(x0), committed (0/1)
    run: Callable[[], None]
    captured: bool
    index: Tensor | None = None  # host [rows] long (pinned on CUDA): the rows a partial staging copies
    copied: object = None  # CUDA event after an input copy that no host read waited for (a step without logits)


def sample_on_device_requested(explicit: bool | None, graphs: bool) -> bool:
    """An option wins; else UNMASK_DEVICE_SAMPLING (0/1); unset: where the step is captured (a replayed graph would
    otherwise copy the sampled rows' logits out, a second read per step). Off the GPU the host samples by
    default, so a seeded request draws what the eager path draws."""
    if explicit is not None:
        return explicit
    env = os.environ.get("UNMASK_DEVICE_SAMPLING")
    if env is None:
        return graphs
    if env.lower() not in _OFF + _ON:
        raise InvalidRequestError(f"UNMASK_DEVICE_SAMPLING must be one of 1/true/yes/on or 0/false/no/off, got {env!r}",
                                  "UNMASK_DEVICE_SAMPLING")
    return env.lower() in _ON


class StaticStep:
    """Runs qualifying steps on static buffers; `execute` returns None for a step it does not take."""

    def __init__(self, model: torch.nn.Module, pool: KVPool, mask_id: int, max_width: int = MAX_WIDTH,
                 max_graphs: int = 128, cuda_graphs: bool | None = None, sample_on_device: bool | None = None,
                 resident: bool = True, sticky_rows: int | None = None):
        """sample_on_device: sampled requests draw inside the step (decoding/device_sample.py); resident: rows whose
        next inputs the step wrote itself are not staged again (static_inputs.Resident; False stages every row
        every step, the same inputs); sticky_rows: up to this many rows a step keeps the last step's wider W
        (None: 4 where the step is captured, where a forward of a few rows costs its weight reads whatever its
        width; 0 off the GPU, where the extra width is compute)."""
        self.model, self.pool, self.mask_id = model, pool, mask_id
        self.device = pool.device
        self.max_width = min(max_width, pool.scratch)
        self.max_graphs = max_graphs
        self.graphs = cuda_graphs_on(self.device, cuda_graphs)
        self.sample = sample_on_device_requested(sample_on_device, self.graphs)
        self.resident = Resident() if resident else None
        self.sticky_rows = (4 if self.graphs else 0) if sticky_rows is None else sticky_rows
        self.last_key: tuple | None = None  # the last step's shape (`key` keeps its K and W where they cover)
        self.mempool = torch.cuda.graph_pool_handle() if self.graphs else None
        self.shapes: OrderedDict[tuple, _Shape] = OrderedDict()
        self.steps = self.captures = self.replays = 0
        self.host_reads = 0   # device-to-host copies of the last step (the sync count: 1 for greedy-only steps)
        self.wait_s = 0.0     # seconds the host spent in those copies, in all (on a GPU: waiting for the step)

    # ------------------------------------------------------------------ which steps
    def key(self, plans: list[StepPlan]) -> tuple | None:
        """(rows, W, context, K) of a step that fits the buffers, else None. K, and W up to `sticky_rows` rows,
        stay those of the last step where they cover this one (padding up to its shape, as vLLM pads a batch up
        to a captured size): the device then holds its rows' inputs already (static_inputs.Resident), where a
        K shrinking as a block fills, or W falling back from a block's first step, would start a new shape."""
        if not plans or len(plans) > ROW_BUCKETS[-1]:
            return None
        width = reach = 0
        for p in plans:
            seg, cache = p.segment, cache_of(p)
            if (type(p.seq) is not Sequence or p.seq.bidirectional or not isinstance(cache, PooledCache)
                    or cache.pool is not self.pool or seg.attend is not None or seg.suffix or seg.block_ids is None
                    or not 0 < seg.length <= self.max_width or seg.start > cache.length):
                return None
            width = max(width, seg.length)
            reach = max(reach, seg.start)
        rows = next(b for b in ROW_BUCKETS if b >= len(plans))
        w = _pow2(width, 1)
        k = min(w, _pow2(max(p.logit_rows.numel() for p in plans), 1))  # the output head reads masked rows only
        last = self.last_key
        if last is not None and last[0] == rows:
            if w < last[1] <= self.max_width and rows <= self.sticky_rows:
                w = last[1]
            if k <= last[3] <= w:
                k = last[3]
        for p in plans:  # a real row's padding tokens write past its segment: that must stay inside its pages
            if p.segment.start + w > cache_of(p).capacity:
                return None
        return rows, w, _pow2(reach + w, MIN_CONTEXT), k

    # ------------------------------------------------------------------ one step
    def execute(self, plans: list[StepPlan]) -> list[Tensor | Proposal] | None:
        """Per plan, a Proposal of its logit rows (requests proposed on the device) or their float32 logits on the
        host."""
        key = self.key(plans)
        if key is None:
            return None
        rules = [row_rule(p.seq, self.sample) for p in plans]
        key += (any(r.temperature > 0 for r in rules),)  # a shape that samples sorts its rows' vocabularies
        self.last_key = key
        shape = self.shapes.get(key)
        if shape is not None and shape.copied is not None:  # the last copy out of this staging tensor must be done
            shape.copied.synchronize()
            shape.copied = None
        if shape is None:
            shape = self._build(key, *self._stage(key, None, plans, rules))
        else:
            self.shapes.move_to_end(key)
            self._stage(key, shape, plans, rules)
        shape.run()
        self.steps += 1
        self.replays += shape.captured
        for p in plans:  # what eager forwards do in commit_cache_lengths
            seg = p.segment
            if seg.write:
                seg.cache.length = seg.start + seg.write
        out = self._outputs(key, shape, plans, rules)
        if not self.host_reads and self.device.type == "cuda":  # no logit rows: nothing waited for the device
            shape.copied = torch.cuda.Event()
            shape.copied.record()
        return out

    def _stage(self, key: tuple, shape: _Shape | None, plans: list[StepPlan],
               rules: list[RowRule]) -> tuple[Tensor, Tensor] | None:
        """The rows the device does not hold already, from the host: all of them in one copy, or (a step where
        some rows were advanced by the last one) those rows' slices, copied into their places. A new shape
        (None): its host staging tensors, every row filled."""
        rows, w, context, k, _ = key
        stale = range(rows) if self.resident is None else self.resident.stale_rows(key, plans, rules)
        pad = rows - len(plans)
        if shape is None:
            pin = self.device.type == "cuda"
            stage = torch.empty(rows, stage_width(w, k, context), dtype=torch.long, pin_memory=pin)
            floats = torch.empty(rows, 3, dtype=torch.float32, pin_memory=pin)
            fill_rows(stage, floats, w, k, context, plans + [None] * pad, rules + [PADDING] * pad,
                      self.pool.scratch_pages)
            return stage, floats
        if len(stale) == rows:
            fill_rows(shape.stage, shape.floats, w, k, context, plans + [None] * pad, rules + [PADDING] * pad,
                      self.pool.scratch_pages)
            shape.inputs.copy_(shape.stage, non_blocking=True)
            shape.dfloats.copy_(shape.floats, non_blocking=True)
        elif stale:
            m = len(stale)
            fill_rows(shape.stage, shape.floats, w, k, context, [plans[i] if i < len(plans) else None for i in stale],
                      [rules[i] if i < len(plans) else PADDING for i in stale], self.pool.scratch_pages)
            shape.index[:m] = torch.tensor(stale)
            idx = shape.index[:m].to(self.device, non_blocking=True)
            shape.inputs.index_copy_(0, idx, shape.stage[:m].to(self.device, non_blocking=True))
            shape.dfloats.index_copy_(0, idx, shape.floats[:m].to(self.device, non_blocking=True))
        return None

    def _build(self, key: tuple, stage: Tensor, floats: Tensor) -> _Shape:
        rows, w, context, k, sampled = key
        inputs, dfloats = stage.to(self.device).clone(), floats.to(self.device).clone()
        c = columns(inputs, w, k)
        batch = StaticBatch(self.pool, c.ids, c.bids, c.start, c.table, context)
        greedy = SamplingParams()
        model, mask_id = self.model, self.mask_id
        cols = torch.arange(k, device=self.device)

        def forward() -> tuple[Tensor, Tensor]:
            batch.prepare()
            hidden = model(c.ids, c.pos, batch)                  # [rows, W, D]
            hidden = hidden.gather(1, c.reads[:, :, None].expand(-1, -1, hidden.shape[-1])).reshape(rows * k, -1)
            logits = model.logits(hidden)                        # [rows x K, V]: the rows a policy reads
            logits[:, mask_id] = float("-inf")                   # never propose the mask (Sequence.apply does too)
            prop = propose(logits, greedy, need_entropy=False)
            tokens, probs, margin, logprobs = prop.tokens, prop.probs, prop.margin, prop.logprobs
            if sampled:  # rows with a temperature draw instead (decoding/device_sample.py)
                temp = dfloats[:, 1].repeat_interleave(k)
                drawn = temp > 0
                s = sample_rows(logits.float(), torch.where(drawn, temp, 1.0), c.top_k.repeat_interleave(k),
                                dfloats[:, 2].repeat_interleave(k), uniforms(c.seed, c.counter, k).reshape(-1))
                tokens, probs, margin, logprobs = (torch.where(drawn, a, b) for a, b in
                                                   ((s.tokens, tokens), (s.probs, probs), (s.margin, margin),
                                                    (s.logprobs, logprobs)))
            # the commit rule on the device too (threshold / topk; decoding/device_select.py)
            valid = cols[None, :] < c.count[:, None]
            first = c.reads[:, 0] == c.first
            commit = commit_rows(probs.view(rows, k), valid, c.rule, dfloats[:, 0], c.quota, first)
            packed = torch.stack([tokens.double(), probs.double(), margin.double(), logprobs.double(),
                                  commit.reshape(-1).double()])
            advance_on_device(c, tokens.view(rows, k), commit)  # the next step's inputs (static_inputs.py)
            return hidden, packed

        shape = self._capture(forward, stage, floats, inputs, dfloats) if self.graphs else None
        if shape is None:  # uncaptured: the same forward on the same buffers, run each step
            shape = _Shape(stage, floats, inputs, dfloats, None, None, lambda: None, False)

            def run() -> None:
                shape.hidden, shape.packed = forward()

            shape.run = run
        shape.index = torch.empty(rows, dtype=torch.long, pin_memory=self.device.type == "cuda")
        self.shapes[key] = shape
        while len(self.shapes) > self.max_graphs:
            self.shapes.popitem(last=False)
        return shape

    def _capture(self, forward: Callable, stage: Tensor, floats: Tensor, inputs: Tensor,
                 dfloats: Tensor) -> _Shape | None:
        saved = inputs.clone()  # the forward advances its inputs: the first replay must start from these
        try:
            graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up on a side stream (CUDA graph docs), refusing anything that syncs
                prev = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    forward()  # writes this step's K/V; the replay below writes the same values again
                finally:
                    torch.cuda.set_sync_debug_mode(prev)
            torch.cuda.current_stream().wait_stream(side)
            inputs.copy_(saved)
            with torch.cuda.graph(graph, pool=self.mempool):
                hidden, packed = forward()
        except Exception as e:  # an op this build or model cannot capture (the MoE's expert loop syncs): no graphs
            self.graphs = False
            inputs.copy_(saved)
            log.warning("CUDA graphs off for the static step (capture failed: %s); it runs uncaptured",
                        str(e).splitlines()[0][:200])
            return None
        inputs.copy_(saved)  # (capturing runs nothing on a GPU; a stand-in that runs the forward advanced them)
        self.captures += 1
        return _Shape(stage, floats, inputs, dfloats, hidden, packed, graph.replay, True)

    # ------------------------------------------------------------------ results
    def _outputs(self, key: tuple, shape: _Shape, plans: list[StepPlan],
                 rules: list[RowRule]) -> list[Tensor | Proposal]:
        k = key[3]
        self.host_reads = 0
        counts = [p.logit_rows.numel() for p in plans]
        cols = flags = None
        if any(r.on_device and m for r, m in zip(rules, counts)):
            t0 = time.perf_counter()
            packed = shape.packed.cpu()  # the step's one synchronisation
            self.wait_s += time.perf_counter() - t0
            self.host_reads += 1
            flags = packed[4].bool()  # [rows x K] commit flags, as the resident rows' check reads them
            # each row's real columns, typed and split once for the whole step (a few ops, not a few per request)
            index = torch.tensor([i * k + j for i, m in enumerate(counts) for j in range(m)], dtype=torch.long)
            real = packed[:, index]
            cols = list(zip(*(t.split(counts) for t in (real[0].long(), real[1].float(), real[2].float(),
                                                          real[3].float(), torch.full((real.shape[1],), float("nan")),
                                                          real[4].bool()))))
        want = [i for i, (r, p) in enumerate(zip(rules, plans)) if not r.on_device and p.logit_rows.numel()]
        host_logits = None
        if want:  # sampled on the host or adjusted requests: their rows' logits, from the graph's hidden states
            flat = torch.cat([torch.arange(plans[i].logit_rows.numel()) + i * k for i in want])
            host_logits = self.model.logits(shape.hidden[flat.to(self.device, non_blocking=True)]).cpu()
            self.host_reads += 1
        out: list[Tensor | Proposal] = []
        decided_rows: list[bool] = []  # rows whose commit the device made: their next inputs are the device's
        taken = 0
        vocab = self.model.lm_head.weight.shape[0]
        for i, (r, m) in enumerate(zip(rules, counts)):
            decided = r.on_device and r.code != HOST
            decided_rows.append(decided and (m == 0 or cols is not None))
            if m == 0:
                out.append(torch.empty(0, vocab))
            elif r.on_device:
                tokens, probs, margin, logprobs, entropy, commit = cols[i]
                if not decided:  # the request's rule runs on the host, over the proposal
                    out.append(Proposal(tokens=tokens, probs=probs, entropy=entropy, margin=margin, logprobs=logprobs))
                else:
                    out.append(DeviceDecision(tokens=tokens, probs=probs, entropy=entropy, margin=margin,
                                              logprobs=logprobs, commit=commit))
            else:
                out.append(host_logits[taken:taken + m])
                taken += m
        if self.resident is not None:
            self.resident.remember(key, plans, rules, decided_rows, flags)
        return out


class HostReads(TorchFunctionMode):
    """Counts the tensor calls that read a tensor back to the host (`.item()`, `.tolist()`, `.cpu()`, `bool()`, a
    boolean index's `nonzero` ...): each is a synchronisation when the tensor is on a GPU. The CPU suite and the
    device check count a step's with it (`with HostReads() as h: runner.execute(plans)`; then h.count)."""

    NAMES = frozenset({"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero"})

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.NAMES:
            self.count += 1
        return func(*args, **(kwargs or {}))

