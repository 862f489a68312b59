"""The static-buffer decode step of the block-causal families, captured as a CUDA graph per shape on a GPU.

A block-causal step feeds each request a short segment (the active block, and at a block's first step the
finished block before it, whose K/V it writes). On a GPU such a step of a 1.7B model is a few hundred small
kernels whose launches cost more than their work (issue 31: about 33 us each on an H200), so the step runs
on fixed buffers instead, and the whole forward is replayed from a CUDA graph:

  * rows: one per request, the batch padded to a bucket of 1, 2, 4, 8, ... rows (vLLM captures a fixed list
    of batch sizes the same way, padding a step up to the next one); width W: the longest segment rounded up
    to a power of two; context: the farthest key any row reads, rounded up likewise; K: the most rows one
    request reads logits from (its masked positions), rounded up likewise. One graph per (rows, W, context,
    K), captured the first time that shape runs (warm-up on a side stream with synchronising ops refused, as
    engine/graphs.py does), replayed after.
  * inputs: token ids, positions, block ids, each row's cache start, its page table (the pool page of each of
    its positions up to the context), the K rows it reads and its commit rule, copied in with one
    host-to-device copy (and one of the rows' thresholds); the pool slots each token writes and each key is
    read from are looked up in the tables inside the graph.
  * padding cannot reach real rows: a padding token has block id PAD_BLOCK, above every real one, so no real
    query sees it (`block_id[k] <= block_id[q]`); a real row's padding tokens write K/V past its segment, at
    positions the next step overwrites before anything reads them (the eager path's scratch rule); padding
    rows read and write the pool's scratch pages, which belong to no request. Rows never mix: norms, linears
    and the MLP act per token and attention per row.
  * the KV cache is the preallocated, paged pool (engine/kv_pool.py); attention gathers each row's keys
    [0, context) through its page table and masks them (the cached prefix whole, the row's own tokens by block id), so no dense
    T x T mask over the whole sequence exists, only [rows, W, context].
  * decoding on the device: the output head (over the K read rows of each row only: a block's committed half
    and the finished block it carries need none), the mask-token ban, the greedy proposal (argmax, p(x0),
    p1 - p2, log p(x0); `decoding.sampling.propose`, the same function the host runs) and, for threshold and
    topk requests, the commit rule (`decoding.device_select`, the batched form of `decoding.policies`'
    rules, with the block's forced first token) run inside the graph; one copy of [5, rows x K] numbers
    (tokens, confidences, commit flags) to the host is the step's only synchronisation, and it carries the
    events the server streams. The host then writes the committed tokens into its canvas; requests under
    another rule run it there over their M proposals. Requests that sample, adjust logits or record top
    alternatives get their rows' logits instead (projected from the graph's hidden states: a second copy).

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
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from unmask.decoding.device_select import HOST, DeviceDecision, commit_rows, rule_code
from unmask.decoding.policies import LEARNED, NEEDS_ENTROPY, SPECULATIVE
from unmask.decoding.sampling import Proposal, SamplingParams, propose
from unmask.engine.graphs import graphs_requested
from unmask.engine.kv_pool import PAGE, KVPool, PooledCache
from unmask.engine.sequence import Sequence, StepPlan
from unmask.models.attention import _SDPA_HAS_GQA, repeat_kv

log = logging.getLogger("unmask.engine")

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_WIDTH = 64          # tokens one row may feed; wider steps (prefill chunks) run eagerly
MIN_CONTEXT = 128       # smallest context bucket: short prompts share one graph per (rows, width, K)
PAD_BLOCK = 1 << 40     # padding tokens' block id: above every real block, so no real query sees them
_OFF = ("0", "false", "no", "off")


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


def _cache(plan: StepPlan):
    """The request's cache; also for a first block that neither reads nor writes one (its K/V go to scratch
    positions of the request's run, which nothing reads before they are written)."""
    return plan.segment.cache if plan.segment.cache is not None else plan.seq.cache


def proposed_on_device(seq: Sequence) -> bool:
    """Whether this request's decision reads only the greedy proposal of each row (tokens, p(x0), p1 - p2,
    log p(x0)): greedy without filtered confidences, a rule that needs no entropy and no logits, nothing that
    edits logits first (penalties, DRY, grammars, min_tokens bans) and no top alternatives to record."""
    s, p = seq.sampling, seq.params
    return (s.greedy and not (s.greedy_filters and (s.top_k > 0 or s.top_p < 1))
            and seq.policy.name not in NEEDS_ENTROPY and seq.policy.name not in ("credit", LEARNED, SPECULATIVE)
            and seq.adjuster is None and seq.dry is None and seq.constraint is None and seq.revise is None
            and seq.top is None and not (p.min_tokens and seq.stops))


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


class _Columns(NamedTuple):
    """Views of a staging tensor [rows, 3W + 5 + K + context / PAGE] (host or device); one copy moves them all."""

    ids: Tensor      # [rows, W] token ids
    pos: Tensor      # [rows, W] positions
    bids: Tensor     # [rows, W] block ids (padding: PAD_BLOCK)
    start: Tensor    # [rows] segment start (the row's cached length)
    count: Tensor    # [rows] read rows that are real (the request's masked targets)
    rule: Tensor     # [rows] device_select rule code
    quota: Tensor    # [rows] topk's tokens per step
    first: Tensor    # [rows] read row forced into the commit (-1: none)
    reads: Tensor    # [rows, K] which of its W rows each row projects to logits
    table: Tensor    # [rows, context / PAGE] the pool page of each row's positions (past its pages: scratch)


def _columns(stage: Tensor, w: int, k: int) -> _Columns:
    wide = [stage[:, i * w:(i + 1) * w] for i in range(3)]
    narrow = [stage[:, 3 * w + i] for i in range(5)]
    return _Columns(*wide, *narrow, stage[:, 3 * w + 5:3 * w + 5 + k], stage[:, 3 * w + 5 + k:])


@dataclass
class _Shape:
    stage: Tensor      # host [rows, 3W + 5 + K + context / PAGE] long (_Columns)
    taus: Tensor       # host [rows] float32: each row's threshold
    inputs: Tensor     # the stage on the device
    dtaus: Tensor      # the thresholds on the device
    hidden: Tensor | None  # [rows x K, D]: final hidden states of the read rows (for logits the host needs)
    packed: Tensor | None  # [5, rows x K] float64: proposed token, p(x0), p1 - p2, log p(x0), committed (0/1)
    run: Callable[[], None]
    captured: bool
    copied: object = None  # CUDA event after an input copy that no host read waited for (a step without logits)


def device_rule(seq: Sequence) -> tuple[int, int, float, int]:
    """(rule code, tokens per step, threshold, block start whose first token is forced or -1) of a request whose
    commit the device decides: a greedy proposal (`proposed_on_device`) under threshold or topk. Others: HOST."""
    if not proposed_on_device(seq):
        return HOST, 0, 1.0, -1
    code = rule_code(seq.policy.name)
    if code == HOST:
        return HOST, 0, 1.0, -1
    forced = seq.block_start if seq.traits.ar_first_token and seq.block.step == 0 else -1
    return code, seq.policy.tokens_per_step or 1, seq.policy.threshold, forced


class StaticStep:
    """Runs qualifying steps on static buffers; `execute` returns None for a step it does not take."""

    def __init__(self, model: torch.nn.Module, pool: KVPool, mask_id: int, max_width: int = MAX_WIDTH,
                 max_graphs: int = 128, cuda_graphs: bool | None = None):
        self.model, self.pool, self.mask_id = model, pool, mask_id
        self.device = pool.device
        self.max_width = min(max_width, pool.scratch)
        self.max_graphs = max_graphs
        self.graphs = cuda_graphs_on(self.device, cuda_graphs)
        self.mempool = torch.cuda.graph_pool_handle() if self.graphs else None
        self.shapes: OrderedDict[tuple, _Shape] = OrderedDict()
        self.steps = self.captures = self.replays = 0
        self.host_reads = 0   # device-to-host copies of the last step (the sync count: 1 for greedy-only steps)
        self.wait_s = 0.0     # seconds the host spent in those copies, in all (on a GPU: waiting for the step)

    # ------------------------------------------------------------------ which steps
    def key(self, plans: list[StepPlan]) -> tuple | None:
        if not plans or len(plans) > ROW_BUCKETS[-1]:
            return None
        width = reach = 0
        for p in plans:
            seg, cache = p.segment, _cache(p)
            if (type(p.seq) is not Sequence or p.seq.bidirectional or not isinstance(cache, PooledCache)
                    or cache.pool is not self.pool or seg.attend is not None or seg.suffix or seg.block_ids is None
                    or not 0 < seg.length <= self.max_width or seg.start > cache.length):
                return None
            width = max(width, seg.length)
            reach = max(reach, seg.start)
        w = _pow2(width, 1)
        reads = max(p.logit_rows.numel() for p in plans)  # rows through the output head: the masked ones only
        for p in plans:  # a real row's padding tokens write past its segment: that must stay inside its pages
            if p.segment.start + w > _cache(p).capacity:
                return None
        rows = next(b for b in ROW_BUCKETS if b >= len(plans))
        return rows, w, _pow2(reach + w, MIN_CONTEXT), min(w, _pow2(reads, 1))

    # ------------------------------------------------------------------ one step
    def execute(self, plans: list[StepPlan]) -> list[Tensor | Proposal] | None:
        """Per plan, a Proposal of its logit rows (greedy requests) or their float32 logits on the host."""
        key = self.key(plans)
        if key is None:
            return None
        shape = self.shapes.get(key)
        if shape is not None and shape.copied is not None:  # the last copy out of this staging tensor must be done
            shape.copied.synchronize()
            shape.copied = None
        stage, taus = self._fill(key, plans, *((shape.stage, shape.taus) if shape is not None else (None, None)))
        if shape is None:
            shape = self._build(key, stage, taus)
        else:
            self.shapes.move_to_end(key)
            shape.inputs.copy_(shape.stage, non_blocking=True)
            shape.dtaus.copy_(shape.taus, non_blocking=True)
        shape.run()
        self.steps += 1
        self.replays += shape.captured
        for p in plans:  # what eager forwards do in commit_cache_lengths
            seg = p.segment
            if seg.write:
                seg.cache.length = seg.start + seg.write
        out = self._outputs(key, shape, plans)
        if not self.host_reads and self.device.type == "cuda":  # no logit rows: nothing waited for the device
            shape.copied = torch.cuda.Event()
            shape.copied.record()
        return out

    def _fill(self, key: tuple, plans: list[StepPlan], stage: Tensor | None, taus: Tensor | None
              ) -> tuple[Tensor, Tensor]:
        """The step's inputs into the host staging tensors: ~25 tensor ops whatever the batch size. `stage` [rows,
        3W + 5 + K + context / PAGE] long (see `_columns`); `taus` [rows] float32, each row's threshold."""
        rows, w, context, k = key
        pin = self.device.type == "cuda"
        if stage is None:
            stage = torch.empty(rows, 3 * w + 5 + k + context // PAGE, dtype=torch.long, pin_memory=pin)
            taus = torch.empty(rows, dtype=torch.float32, pin_memory=pin)
        c = _columns(stage, w, k)
        n = len(plans)
        j = torch.arange(w)
        lengths = torch.tensor([p.segment.length for p in plans])
        starts = torch.tensor([p.segment.start for p in plans])
        valid = j[None, :] < lengths[:, None]
        c.ids.zero_()
        c.bids.fill_(PAD_BLOCK)
        c.ids[:n][valid] = torch.cat([p.token_ids for p in plans])  # host tensors (Sequence.seq)
        c.bids[:n][valid] = torch.cat([p.segment.block_ids for p in plans])
        c.pos[:n] = starts[:, None] + j
        c.pos[n:] = j
        c.start[:n] = starts
        c.start[n:] = 0
        # page tables: a row's own pages, then (reads only, masked) a scratch page; padding rows write and read
        # the scratch pages alone
        scratch = torch.tensor(self.pool.scratch_pages)
        c.table[:] = scratch[torch.arange(context // PAGE) % len(scratch)]
        tables = [_cache(p).table[:context // PAGE] for p in plans]
        c.table[:n][torch.arange(context // PAGE)[None, :] < torch.tensor([len(t) for t in tables])[:, None]] = \
            torch.cat(tables)
        counts = torch.tensor([p.logit_rows.numel() for p in plans])
        c.reads.zero_()  # which of its W rows each row projects (padding: row 0)
        c.reads[:n][torch.arange(k)[None, :] < counts[:, None]] = torch.cat([p.logit_rows for p in plans])
        c.count[:n] = counts
        c.count[n:] = 0
        # the commit rule of each request the device decides for (decoding/device_select.py); HOST: the host does
        rules = [device_rule(p.seq) for p in plans]
        c.rule[:n] = torch.tensor([r for r, _, _, _ in rules])
        c.rule[n:] = HOST
        c.quota[:n] = torch.tensor([q for _, q, _, _ in rules])
        taus[:n] = torch.tensor([t for _, _, t, _ in rules], dtype=torch.float32)
        taus[n:] = 1.0
        # a family that writes a block's first token autoregressively: the read row of that token (-1: none)
        c.first[:n] = torch.tensor([f - p.segment.start - int(p.seq.traits.shift) if f >= 0 else -1
                                    for p, (_, _, _, f) in zip(plans, rules)])
        c.first[n:] = -1
        return stage, taus

    def _build(self, key: tuple, stage: Tensor, taus: Tensor) -> _Shape:
        rows, w, context, k = key
        inputs, dtaus = stage.to(self.device).clone(), taus.to(self.device).clone()
        c = _columns(inputs, w, k)
        batch = StaticBatch(self.pool, c.ids, c.bids, c.start, c.table, context)
        greedy = SamplingParams()
        model, mask_id = self.model, self.mask_id
        columns = torch.arange(k, device=self.device)

        def forward() -> tuple[Tensor, Tensor]:
            batch.prepare()
            hidden = model(c.ids, c.pos, batch)                  # [rows, W, D]
            hidden = hidden.gather(1, c.reads[:, :, None].expand(-1, -1, hidden.shape[-1])).reshape(rows * k, -1)
            logits = model.logits(hidden)                        # [rows x K, V]: the rows a policy reads
            logits[:, mask_id] = float("-inf")                   # never propose the mask (Sequence.apply does too)
            prop = propose(logits, greedy, need_entropy=False)
            # the commit rule on the device too (threshold / topk; decoding/device_select.py)
            valid = columns[None, :] < c.count[:, None]
            first = c.reads[:, 0] == c.first
            commit = commit_rows(prop.probs.view(rows, k), valid, c.rule, dtaus, c.quota, first)
            packed = torch.stack([prop.tokens.double(), prop.probs.double(), prop.margin.double(),
                                  prop.logprobs.double(), commit.reshape(-1).double()])
            return hidden, packed

        shape = self._capture(forward, stage, taus, inputs, dtaus) if self.graphs else None
        if shape is None:  # uncaptured: the same forward on the same buffers, run each step
            shape = _Shape(stage, taus, inputs, dtaus, None, None, lambda: None, False)

            def run() -> None:
                shape.hidden, shape.packed = forward()

            shape.run = run
        self.shapes[key] = shape
        while len(self.shapes) > self.max_graphs:
            self.shapes.popitem(last=False)
        return shape

    def _capture(self, forward: Callable, stage: Tensor, taus: Tensor, inputs: Tensor,
                 dtaus: Tensor) -> _Shape | None:
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
            with torch.cuda.graph(graph, pool=self.mempool):
                hidden, packed = forward()
        except Exception as e:  # an op this build or model cannot capture (the MoE's expert loop syncs): no graphs
            self.graphs = False
            log.warning("CUDA graphs off for the static step (capture failed: %s); it runs uncaptured",
                        str(e).splitlines()[0][:200])
            return None
        self.captures += 1
        return _Shape(stage, taus, inputs, dtaus, hidden, packed, graph.replay, True)

    # ------------------------------------------------------------------ results
    def _outputs(self, key: tuple, shape: _Shape, plans: list[StepPlan]) -> list[Tensor | Proposal]:
        k = key[3]
        on_device = [proposed_on_device(p.seq) for p in plans]
        self.host_reads = 0
        cols = None
        if any(d and p.logit_rows.numel() for d, p in zip(on_device, plans)):
            t0 = time.perf_counter()
            packed = shape.packed.cpu()  # the step's one synchronisation
            self.wait_s += time.perf_counter() - t0
            self.host_reads += 1
            # typed once for the whole step; each request below takes views (a few us, not a few ops each)
            cols = (packed[0].long(), packed[1].float(), packed[2].float(), packed[3].float(),
                    torch.full((packed.shape[1],), float("nan")), packed[4].bool())
        want = [i for i, (d, p) in enumerate(zip(on_device, plans)) if not d and p.logit_rows.numel()]
        host_logits = None
        if want:  # sampled or adjusted requests: their rows' logits, projected from the graph's hidden states
            flat = torch.cat([torch.arange(plans[i].logit_rows.numel()) + i * k for i in want])
            host_logits = self.model.logits(shape.hidden[flat.to(self.device, non_blocking=True)]).cpu()
            self.host_reads += 1
        out: list[Tensor | Proposal] = []
        taken = 0
        vocab = self.model.lm_head.weight.shape[0]
        for i, (d, p) in enumerate(zip(on_device, plans)):
            m = p.logit_rows.numel()
            if m == 0:
                out.append(torch.empty(0, vocab))
            elif d:
                tokens, probs, margin, logprobs, entropy, commit = (c[i * k:i * k + m] for c in cols)
                if rule_code(p.seq.policy.name) == HOST:  # the request's rule runs on the host, over the proposal
                    out.append(Proposal(tokens=tokens, probs=probs, entropy=entropy, margin=margin, logprobs=logprobs))
                else:
                    out.append(DeviceDecision(tokens=tokens, probs=probs, entropy=entropy, margin=margin,
                                              logprobs=logprobs, commit=commit))
            else:
                out.append(host_logits[taken:taken + m])
                taken += m
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

