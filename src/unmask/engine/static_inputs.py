"""The static step's inputs: staged on the host for the rows that need it, advanced on the device for the rest.

A static step (engine/static_step.py) reads one long tensor per shape, [rows, 3W + 10 + K + context / PAGE]
(`Columns`), and one float tensor [rows, 3] (each row's threshold, temperature and top-p). The host stages a
row there when the row's layout is new (a request joins, a block starts, the shape changed); the step itself
writes the next step's inputs of every row at its end (`advance_on_device`): the committed tokens into the
row's canvas (its token ids), the read rows that stay masked, their count, the forced-first column cleared,
the draw counter + 1, and after a block's first step (which writes the finished block's K/V) the segment
moved past what it wrote. The page table does not change while a request runs, so a row whose next plan is
what the step left (`Resident.stale_rows` checks it against the
step's own commit flags, which the host read anyway) needs nothing from the host: no staging, no copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from unmask.decoding.device_select import HOST, rule_code
from unmask.decoding.policies import LEARNED, NEEDS_ENTROPY, SPECULATIVE
from unmask.engine.kv_pool import PAGE
from unmask.engine.sequence import Sequence, StepPlan

PAD_BLOCK = 1 << 40     # padding tokens' block id: above every real block, so no real query sees them
NARROW = 10             # start, count, rule, quota, first, shift, top_k, seed, counter, write
_EMPTY = torch.empty(0, dtype=torch.long)
_TAG = 1 << 32          # read rows are < MAX_WIDTH: row i's values tagged i x _TAG stay apart


class Columns(NamedTuple):
    """Views of a staging tensor (host or device); one copy moves them all."""

    ids: Tensor      # [rows, W] token ids: the row's canvas segment, committed tokens written in
    pos: Tensor      # [rows, W] positions
    bids: Tensor     # [rows, W] block ids (padding: PAD_BLOCK)
    start: Tensor    # [rows] segment start (the row's cached length)
    count: Tensor    # [rows] read rows that are real (the request's masked targets)
    rule: Tensor     # [rows] device_select rule code
    quota: Tensor    # [rows] topk's tokens per step
    first: Tensor    # [rows] read row forced into the commit (-1: none)
    shift: Tensor    # [rows] 1 where a read row predicts the token after it (shifted families), else 0
    top_k: Tensor    # [rows] sampling's top-k (0: off)
    seed: Tensor     # [rows] the request's seed for device draws (decoding/device_sample.py)
    counter: Tensor  # [rows] the request's draw counter: its forwards so far
    write: Tensor    # [rows] leading tokens whose K/V this step stores (a block's first step: the finished block)
    reads: Tensor    # [rows, K] which of its W rows each row projects to logits
    table: Tensor    # [rows, context / PAGE] the pool page of each row's positions (past its pages: scratch)


def columns(stage: Tensor, w: int, k: int) -> Columns:
    wide = [stage[:, i * w:(i + 1) * w] for i in range(3)]
    narrow = [stage[:, 3 * w + i] for i in range(NARROW)]
    return Columns(*wide, *narrow, stage[:, 3 * w + NARROW:3 * w + NARROW + k], stage[:, 3 * w + NARROW + k:])


def stage_width(w: int, k: int, context: int) -> int:
    return 3 * w + NARROW + k + context // PAGE


def cache_of(plan: StepPlan):
    """The request's cache; also for a first block that neither reads nor writes one (its K/V go to scratch
    positions of the request's run, which nothing reads before they are written)."""
    return plan.segment.cache if plan.segment.cache is not None else plan.seq.cache


def proposal_on_device(seq: Sequence, sample: bool) -> bool:
    """Whether this request's decision reads only one proposal per row (token, p(x0), p1 - p2, log p(x0)) that the
    step can make: greedy without filtered confidences, or (`sample`: the step draws on the device) sampled with
    temperature, top-k and top-p; a rule that needs no entropy and no logits; nothing that edits logits first
    (penalties, DRY, grammars, min_tokens bans) and no top alternatives to record."""
    s, p = seq.sampling, seq.params
    ok = not (s.greedy_filters and (s.top_k > 0 or s.top_p < 1)) if s.greedy else sample
    return (ok and seq.policy.name not in NEEDS_ENTROPY and seq.policy.name not in ("credit", LEARNED, SPECULATIVE)
            and seq.adjuster is None and seq.dry is None and seq.constraint is None and seq.revise is None
            and seq.top is None and not (p.min_tokens and seq.stops))


@dataclass(frozen=True)
class RowRule:
    """What the step needs of a request's decision besides its tokens. on_device False: its rows' logits go to the
    host; code HOST with on_device: the host runs the rule over the device's proposal."""

    on_device: bool = False
    code: int = HOST
    quota: int = 0
    tau: float = 1.0
    # block start whose first token is forced into the commit, or -1 (not compared: a resident row's is -1, checked
    # apart)
    forced: int = field(default=-1, compare=False)
    temperature: float = 0.0  # > 0: drawn on the device
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


PADDING = RowRule()


def row_rule(seq: Sequence, sample: bool) -> RowRule:
    if not proposal_on_device(seq, sample):
        return PADDING
    code, s = rule_code(seq.policy.name), seq.sampling
    forced = seq.block_start if code != HOST and seq.traits.ar_first_token and seq.block.step == 0 else -1
    seed = seq.params.seed if seq.params.seed is not None else seq.generator.initial_seed()
    drawn = not s.greedy
    return RowRule(True, code, seq.policy.tokens_per_step or 1, seq.policy.threshold, forced,
                   s.temperature, s.top_k if drawn else 0, s.top_p if drawn else 1.0, seed % (1 << 63))


def fill_rows(stage: Tensor, floats: Tensor, w: int, k: int, context: int, plans: list[StepPlan | None],
              rules: list[RowRule], scratch_pages: list[int]) -> None:
    """Rows [0, len(plans)) of the host staging tensors (None: a padding row), in ~30 tensor ops whatever their
    number; `floats` [rows, 3]: threshold, temperature, top-p."""
    n = len(plans)
    c = columns(stage[:n], w, k)
    live = [p for p in plans if p is not None]
    j = torch.arange(w)
    lengths = torch.tensor([p.segment.length if p is not None else 0 for p in plans])
    starts = torch.tensor([p.segment.start if p is not None else 0 for p in plans])
    valid = j[None, :] < lengths[:, None]
    c.ids.zero_()
    c.bids.fill_(PAD_BLOCK)
    if live:
        c.ids[valid] = torch.cat([p.token_ids for p in live])  # host tensors (Sequence.seq)
        c.bids[valid] = torch.cat([p.segment.block_ids for p in live])
    c.pos.copy_(starts[:, None] + j)
    c.start.copy_(starts)
    # page tables: a row's own pages, then (reads only, masked) a scratch page; padding rows write and read
    # the scratch pages alone
    pages = context // PAGE
    scratch = torch.tensor(scratch_pages)
    c.table.copy_(scratch[torch.arange(pages) % len(scratch)].expand(n, -1))
    tables = [cache_of(p).table[:pages] if p is not None else _EMPTY for p in plans]
    c.table[torch.arange(pages)[None, :] < torch.tensor([len(t) for t in tables])[:, None]] = torch.cat(tables)
    counts = torch.tensor([p.logit_rows.numel() if p is not None else 0 for p in plans])
    c.reads.zero_()  # which of its W rows each row projects (padding: row 0)
    if live:
        c.reads[torch.arange(k)[None, :] < counts[:, None]] = torch.cat([p.logit_rows for p in live])
    c.count.copy_(counts)
    shifts = [int(p.seq.traits.shift) if p is not None else 0 for p in plans]
    c.shift.copy_(torch.tensor(shifts))
    longs = torch.tensor([(r.code, r.quota, r.top_k, r.seed, p.seq.stats.forwards if p is not None else 0,
                           r.forced - p.segment.start - s if r.forced >= 0 else -1,
                           p.segment.write if p is not None else 0)
                          for p, r, s in zip(plans, rules, shifts)], dtype=torch.long)
    for col, values in zip((c.rule, c.quota, c.top_k, c.seed, c.counter, c.first, c.write), longs.unbind(1)):
        col.copy_(values)
    floats[:n] = torch.tensor([(r.tau, r.temperature, r.top_p) for r in rules], dtype=torch.float32)


def advance_on_device(c: Columns, tokens: Tensor, commit: Tensor) -> None:
    """The next step's inputs, written by the step (inside the captured graph): each committed token [rows, K] into
    its canvas column (read row + shift), the read rows left masked moved to the front in order (padding: row 0),
    their count, no forced first column, the draw counter + 1; and where the step wrote K/V (a block's first
    step carries the finished block), the segment moved past what it wrote, as the next plan starts where the
    cache now ends. Exactly what `fill_rows` stages for the row's next plan when that plan is this segment
    (less what was written) with the host's commit equal to this one (Resident checks it)."""
    rows, w = c.ids.shape
    k = c.reads.shape[1]
    dev = c.ids.device
    canvas_col = c.reads + c.shift[:, None]
    hit = (canvas_col[:, None, :] == torch.arange(w, device=dev)[None, :, None]) & commit[:, None, :]
    ids = torch.where(hit.any(dim=2), (hit.long() * tokens[:, None, :]).sum(dim=2), c.ids)
    keep = (torch.arange(k, device=dev)[None, :] < c.count[:, None]) & ~commit
    dest = torch.where(keep, keep.long().cumsum(dim=1) - 1, k)  # a kept row's new place; the rest to a spare column
    moved = torch.zeros(rows, k + 1, dtype=c.reads.dtype, device=dev).scatter_(1, dest, c.reads)[:, :k]
    # past the written prefix: token j of the next segment is token j + write of this one (a segment's real
    # tokens are a prefix of its row: the rest has block id PAD_BLOCK)
    wr = c.write
    cols = torch.arange(w, device=dev)[None, :]
    real = cols < ((c.bids != PAD_BLOCK).sum(dim=1) - wr)[:, None]
    src = (cols + wr[:, None]).clamp(max=w - 1)
    c.ids.copy_(torch.where(real, ids.gather(1, src), 0))
    c.bids.copy_(torch.where(real, c.bids.gather(1, src), PAD_BLOCK))
    c.pos.add_(wr[:, None])
    c.start.add_(wr)
    count = keep.sum(dim=1)
    c.reads.copy_(torch.where(torch.arange(k, device=dev)[None, :] < count[:, None], (moved - wr[:, None]).clamp(min=0),
                              0))
    c.count.copy_(count)
    c.write.zero_()
    c.first.fill_(-1)
    c.counter.add_(1)


@dataclass
class _Row:
    seq: Sequence
    start: int    # the segment the device moved the row to: past what the step wrote
    length: int
    cache: object
    rule: RowRule
    read: Tensor  # the step's read rows (logit_rows); the device kept those its commit left masked, less `write`
    write: int


class Resident:
    """What the device's input buffers of the last step's shape hold for each row after `advance_on_device`."""

    def __init__(self):
        self.key: tuple | None = None
        self.rows: list[_Row | None] = []
        self.commit: Tensor | None = None  # the last step's commit flags [rows x K] (host), as the device made them
        self.resident = self.staged = 0  # requests' rows that needed nothing from the host / that it staged, in all

    def stale_rows(self, key: tuple, plans: list[StepPlan], rules: list[RowRule]) -> list[int]:
        """Rows of the step's buffers the host must stage: every one when the shape is not the last step's, else
        the rows whose plan is not the segment the device advanced (another request, another segment, a write,
        another rule or sampling, read rows other than those the device kept: the host committed otherwise,
        or a stop cut the targets), and rows that held a request last step and are padding now."""
        rows = key[0]
        if key != self.key:
            stale = list(range(rows))
        else:
            same = [i for i, (p, r) in enumerate(zip(plans, rules)) if self._same_segment(i, p, r)]
            ok = set(self._same_reads(key[3], plans, same))
            stale = [i for i in range(len(plans)) if i not in ok]
            stale += [i for i in range(len(plans), rows) if i < len(self.rows) and self.rows[i] is not None]
        real = sum(i < len(plans) for i in stale)
        self.staged += real
        self.resident += len(plans) - real
        return stale

    def _same_segment(self, i: int, p: StepPlan, r: RowRule) -> bool:
        was = self.rows[i] if i < len(self.rows) else None
        seg = p.segment
        return (was is not None and was.seq is p.seq and was.start == seg.start and was.length == seg.length
                and seg.write == 0 and r.forced < 0 and was.cache is cache_of(p) and was.rule == r)

    def _same_reads(self, k: int, plans: list[StepPlan], rows: list[int]) -> list[int]:
        """Of `rows`, those whose plan reads exactly the rows the device kept: one comparison for all of them (the
        per-row tensor ops would cost more host time than the staging they save), per row only on a mismatch.
        Each value is tagged with its row, so that equal concatenations mean equal rows; nothing is read out of
        a tensor (HostReads counts such calls as device reads)."""
        if not rows:
            return []
        if self.commit is None:  # no row had read rows last step: nothing was committed
            return [i for i in rows if plans[i].logit_rows.numel() == 0 and self.rows[i].read.numel() == 0]
        prev = [(i, self.rows[i].read.numel(), self.rows[i].write) for i in rows]
        flags = torch.tensor([i * k + j for i, m, _ in prev for j in range(m)], dtype=torch.long)
        shift = torch.tensor([i * _TAG - w for i, m, w in prev for _ in range(m)], dtype=torch.long)
        expected = (torch.cat([self.rows[i].read for i in rows]) + shift)[~self.commit[flags]]
        tags = torch.tensor([i * _TAG for i in rows for _ in range(plans[i].logit_rows.numel())], dtype=torch.long)
        if torch.equal(expected, torch.cat([plans[i].logit_rows for i in rows]) + tags):
            return rows
        return [i for i in rows if self._same_reads(k, plans, [i]) == [i]] if len(rows) > 1 else []

    def remember(self, key: tuple, plans: list[StepPlan], rules: list[RowRule], decided: list[bool],
                 commit: Tensor | None) -> None:
        """After the step: the rows the device advanced from its own commit flags `commit` [rows x K] (`decided[i]`
        False where the host decided or had no proposal: those rows are staged next time)."""
        self.key, self.commit = key, commit
        self.rows = [_Row(p.seq, p.segment.start + p.segment.write, p.segment.length - p.segment.write, cache_of(p),
                          r, p.logit_rows, p.segment.write) if d else None
                     for p, r, d in zip(plans, rules, decided)]
