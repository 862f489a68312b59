"""One request's decoding state and the per-step plan it feeds to the model.

State is counters, not phases: `cached` (tokens whose K/V are stored), the active block
[block_start, block_end), `final_end` (end of the committed prefix with no mask before it).
Prefill, denoising and committing a finished block are the same plan with different ranges:
block-causal families feed [committed-but-uncached tokens ; active block] and write the first
part's K/V in the same forward (no separate commit pass).
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from torch import Tensor

from unmask.decoding import BlockState, decide
from unmask.decoding.commit_filter import CONFIG_KEY, CommitFilter
from unmask.decoding.dry import dry_penalty
from unmask.decoding.policies import LEARNED, Decision
from unmask.decoding.logit_adjust import Adjuster, ban_early_stops
from unmask.decoding.ngram_drafts import NgramTable
from unmask.decoding.sampling import Proposal, top_logprobs
from unmask.decoding.targets import decode_window, defer_late_stops, first_stop, masked_in
from unmask.engine.params import GenerationParams, model_defaults
from unmask.engine.revising import RevisingSteps
from unmask.errors import ContextLengthError
from unmask.models.attention import KVCache, Segment

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class ModelTraits:
    """What the engine needs from a family, without the model itself."""

    attention: str          # "bidirectional" | "block_causal"
    shift: bool
    mask_id: int
    block_size: int
    stop_ids: tuple[int, ...]
    ar_first_token: bool
    max_context: int
    causal_context: bool = False  # committed tokens attend token-causally (unmask.train.objectives)
    # the checkpoint's config.json / generation_config.json, for families with their own sequence class
    config: dict = field(default_factory=dict, compare=False)
    generation_config: dict = field(default_factory=dict, compare=False)
    family: str = ""  # the registry's family name: its reference sampler's defaults (params.FAMILY_DEFAULTS)
    # the checkpoint's n-gram draft table (decoding.ngram_drafts), for policy speculative; None: it has none
    ngram_drafts: NgramTable | None = field(default=None, compare=False, repr=False)

    @property
    def defaults(self) -> dict:
        """Request defaults of this model's reference sampler (params.model_defaults); the last-block and
        sub-block switches only where blocks are decoded block-causally."""
        out = model_defaults(self.family, self.generation_config)
        if self.attention != "block_causal":
            out.pop("full_last_block", None)
            out.pop("small_block_size", None)
        return out

    def check_canvas(self, prompt_len: int, params: GenerationParams) -> None:
        """With full_last_block the canvas runs to the end of the block holding the last output position:
        that end must fit the model's context (ContextLengthError otherwise)."""
        p = params.resolved(self.defaults, self.block_size)
        if p.full_last_block and self.attention == "block_causal":
            B = p.block_size or self.block_size
            end = -(-(prompt_len + p.max_tokens) // B) * B
            if end > self.max_context:
                raise ContextLengthError(
                    f"full_last_block: prompt ({prompt_len} tokens) plus max_tokens ({p.max_tokens}) rounded up to "
                    f"whole blocks of {B} is {end} tokens, over this model's context of {self.max_context}",
                    "max_tokens")

    @property
    def commit_filter(self) -> CommitFilter | None:
        """The learned commit rule fitted to this model (`unmask calibrate`), if its generation_config has one."""
        raw = self.generation_config.get(CONFIG_KEY)
        return None if raw is None else CommitFilter.from_json(raw)


class TopStore:
    """The k most likely tokens and their log-probabilities at each output position (`top_logprobs`)."""

    def __init__(self, n: int, k: int):
        self.ids = torch.zeros(n, k, dtype=torch.long)
        self.logprobs = torch.zeros(n, k)

    def record(self, index: Tensor, rows: Tensor, temperature: float) -> None:
        if rows.shape[0]:
            ids, lps = top_logprobs(rows, self.ids.shape[1], temperature)
            self.ids[index.cpu()], self.logprobs[index.cpu()] = ids.cpu(), lps.cpu()

    def slice(self, start: int, n: int) -> list[list[tuple[int, float]]]:
        ids, lps = self.ids[start:start + n].tolist(), self.logprobs[start:start + n].tolist()
        return [list(zip(i, lp)) for i, lp in zip(ids, lps)]


def new_top_store(p: GenerationParams) -> TopStore | None:
    return TopStore(p.max_tokens, p.top_logprobs) if p.logprobs and p.top_logprobs else None


@dataclass
class StepPlan:
    seq: "Sequence"
    token_ids: Tensor     # [n]
    positions: Tensor     # [n]
    segment: Segment
    logit_rows: Tensor    # [m] rows of this plan whose hidden states are projected to logits
    targets: Tensor       # [m] absolute canvas positions those logits predict


@dataclass
class Stats:
    forwards: int = 0         # forwards this request took part in
    prefill_forwards: int = 0  # of them, those that only wrote prompt tokens (a chunked prefill's chunks)
    denoise_steps: int = 0    # forwards that committed tokens
    prefill_tokens: int = 0
    edits: int = 0            # committed tokens replaced by another (edit_threshold)
    remasks: int = 0          # committed tokens put back to mask (remask_budget)


@dataclass
class Sequence(RevisingSteps):
    prompt_ids: list[int]
    params: GenerationParams
    traits: ModelTraits
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stats: Stats = field(default_factory=Stats)
    cache: KVCache | None = None
    constraint: Any = None   # unmask.structured.Constraint, set by the engine for structured requests
    error: Any = None        # an InvalidRequestError the request ends with (a constrained answer that failed its check)

    supports_constraints: ClassVar[bool] = True  # other sequence classes (uniform noise) lack the hook

    def __post_init__(self):
        self.params = self.params.resolved(self.traits.defaults, self.traits.block_size)  # the model's defaults
        t, p = self.traits, self.params
        self.P = len(self.prompt_ids)
        self.B = p.block_size or t.block_size
        self.end = self.P + p.max_tokens              # the output never grows past this
        self.S = len(p.suffix_ids)                    # infilling: suffix tokens after the span, at [end, end+S)
        self.bidirectional = t.attention == "bidirectional"
        if self.S and not self.bidirectional:
            raise ValueError("a suffix after the generated span needs a bidirectional family")
        exact = p.cache == "auto" or self.S > 0       # infills always decode exactly (the whole canvas each step)
        self.cache_mode = ("none" if exact else p.cache) if self.bidirectional else "exact"
        self.stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(t.stop_ids))
        self.stop_tensor = torch.tensor(sorted(self.stops - {t.mask_id}), dtype=torch.long)  # a mask is no commit
        self.sub = p.small_block_size                 # Fast-dLLM v2 sub-blocks; None: the block is one
        self.multi = p.multi_block_threshold          # D2F / d3LLM: the next block opens at this committed share
        self.generator = torch.Generator()  # unseeded: a fresh seed for this request alone (the global RNG is untouched)
        if p.seed is not None:
            self.generator.manual_seed(p.seed)
        else:
            self.generator.seed()
        self.policy = p.policy_config()
        edits = p.edit_config()
        self.revise = edits if edits.active else None  # None: a committed token is final (the default)
        self.edited: list[int] = []                    # output indices this step replaced or remasked
        if self.policy.name == LEARNED:  # the filter belongs to the model, the threshold to the request
            self.policy = replace(self.policy, commit_filter=t.commit_filter)
        self.sampling = p.sampling()
        adjust = p.logit_adjust()
        self.adjuster = Adjuster(adjust, self.prompt_ids) if adjust.active else None
        dry = p.dry()
        self.dry = dry if dry.active else None
        self.dry_breakers: Tensor | None = None   # [V] bool, set by the engine from its tokenizer
        if self.bidirectional:
            self.block_start = self.P                 # LLaDA semi-AR: blocks count from the answer start
            self.seq = torch.full((self.end + self.S,), t.mask_id, dtype=torch.long)
            if self.S:
                self.seq[self.end:] = torch.tensor(p.suffix_ids, dtype=torch.long)
        # the canvas ends with the output, unless the last block is decoded whole (SDAR's and LLaDA2's references)
        self.full_last = bool(p.full_last_block) and not self.bidirectional
        if not self.bidirectional:
            self.block_start = (self.P // self.B) * self.B  # absolute alignment (SDAR, LLaDA2, Fast-dLLM v2)
            self.seq = torch.full((self.canvas_end,), t.mask_id, dtype=torch.long)
        self.seq[: self.P] = torch.tensor(self.prompt_ids, dtype=torch.long)
        self.block_end = min(self.block_start + self.B, self.canvas_end)
        self.cached = 0
        self.final_end = self.P      # generated text is final up to here
        self.stop_at: int | None = None
        self.logprobs = torch.zeros(p.max_tokens) if p.logprobs else None
        self.top = new_top_store(p)
        self._open_window()
        self._new_block()

    def _new_block(self) -> None:
        """Revision state of the active block: nothing final in it until it is settled (unmask.decoding.edits)."""
        self.settled = self.revise is None
        self.post_edit_steps = 0
        self.remask_left = self.revise.remask_budget if self.revise is not None else 0
        self.first_row: Tensor | None = None  # shifted block-causal: the logits that predict the block's first token

    @property
    def canvas_end(self) -> int:
        """End of the decoded canvas: the output's end, or with full_last_block the end of its last block."""
        return -(-self.end // self.B) * self.B if self.full_last else self.end

    # ------------------------------------------------------------------ planning
    def _window(self) -> tuple[int, int]:
        return decode_window(self.seq, self.block_start, self.block_end, self.traits.mask_id, self.sub)

    def _open_window(self) -> None:
        """A fresh policy state for the block, or for its next sub-block: schedules count per window."""
        self.window_start = self._window()[0]
        self.block = BlockState(initial_masked=self._masked_in_block())

    def _masked_in_block(self) -> int:
        """Masks of the window the policy's schedule covers (the block, or its active sub-block)."""
        lo, hi = self._window()
        return int((self.seq[lo:hi] == self.traits.mask_id).sum())

    def view_end(self) -> int:
        """End of what a step decodes: the active block, and with `multi` the next block too once the active
        one's committed share reaches it (committing only adds tokens, so once open it stays open)."""
        if self.multi is None or self.block_end >= self.canvas_end:
            return self.block_end
        n = self.block_end - self.block_start
        done = n - int((self.seq[self.block_start:self.block_end] == self.traits.mask_id).sum())
        return min(self.block_end + self.B, self.canvas_end) if done / n >= self.multi else self.block_end

    def masked_positions(self) -> Tensor:
        """This step's targets: the window's masks (with an open next block, its masks too), minus those after
        a stop token committed there (the output ends at that token, so only the holes before it still matter)."""
        lo, hi = self._window()
        if self.multi is not None:  # never with sub-blocks: the window is the whole block
            hi = self.view_end()
        out_hi = min(hi, self.end)  # a stop token past max_tokens (full_last_block) is not part of the output
        stop = first_stop(self.seq, self.final_end, out_hi, self.stop_tensor)
        if stop < out_hi:
            hi = stop
        return masked_in(self.seq, lo, hi, self.traits.mask_id)

    @property
    def prefill_limit(self) -> int:
        """Prompt tokens that may enter the cache before the first decoding pass (prefix cache, chunked
        prefill). A shifted family reads a block's first token from the last row of the block before it,
        so that prompt block must run in the first pass."""
        return max(0, self.block_start - self.B) if self.traits.shift else self.block_start

    def plan(self, token_budget: int) -> StepPlan:
        if self.bidirectional:
            return self._plan_bidirectional()
        return self._plan_block_causal(token_budget)

    def _plan_block_causal(self, budget: int) -> StepPlan:
        B, pending = self.B, self.block_start - self.cached
        if pending > budget:  # chunked prefill: whole blocks, write only
            n = min(pending, max(B, budget // B * B), self.prefill_limit - self.cached)
            if n > 0:
                return self._make_plan(self.cached, self.cached + n, write=n, targets=None)
        targets = self.masked_positions()
        first_unreadable = self.traits.shift and pending == 0 and self.cached > 0 and targets.numel() > 0
        if first_unreadable and int(targets[0]) == self.cached:
            # no row can predict the block's first token: fail loudly instead of stepping forever
            raise RuntimeError("a shifted model needs the block before the answer in the first pass; "
                               f"the cache already holds {self.cached} tokens")
        # an open next block rides in the same forward; with a causal context _make_plan groups it with the
        # active block, and nothing past block_start is written, so the cache stays exact
        return self._make_plan(self.cached, self.view_end(), write=pending, targets=self._with_editable(targets))

    def _plan_bidirectional(self) -> StepPlan:
        s = int(self.traits.shift)
        first_step = self.block.step == 0
        targets = self._with_editable(self.masked_positions())
        if self.cache_mode == "none":
            return self._make_plan(0, self.end + self.S, write=0, targets=targets)
        if first_step:  # refresh: full canvas, store what later steps read
            write = self.end if self.cache_mode == "dual" else self.block_start - s
            return self._make_plan(0, self.end, write=write, targets=targets)
        stop = self.block_end if self.cache_mode == "dual" else self.end
        return self._make_plan(self.block_start - s, stop, write=0, targets=targets,
                               suffix=self.end - stop)

    def _make_plan(self, lo: int, hi: int, write: int, targets: Tensor | None, suffix: int = 0) -> StepPlan:
        positions = torch.arange(lo, hi)
        uses_cache = write > 0 or lo > 0 or suffix > 0
        if self.bidirectional:
            block_ids = None
        elif self.traits.causal_context:  # written tokens causal; the active block one bidirectional group
            block_ids = torch.clamp(positions, max=self.block_start)
        else:
            block_ids = positions // self.B
        segment = Segment(start=lo, length=hi - lo, write=write, suffix=suffix,
                          cache=self.cache if uses_cache else None, block_ids=block_ids)
        if targets is None or targets.numel() == 0:
            rows = targets = torch.empty(0, dtype=torch.long)
        else:
            rows = targets - lo - int(self.traits.shift)
            ok = rows >= 0  # a shifted family cannot predict a segment's first token
            rows, targets = rows[ok], targets[ok]
        return StepPlan(self, self.seq[lo:hi], positions, segment, rows, targets)

    # ------------------------------------------------------------------ applying results
    def after_forward(self, plan: StepPlan) -> None:
        self.stats.forwards += 1
        seg = plan.segment
        if not self.bidirectional and seg.write:
            self.cached = seg.start + seg.write
            self.stats.prefill_tokens += max(0, min(seg.start + seg.write, self.P) - seg.start)

    def apply(self, plan: StepPlan, logits: Tensor) -> list[int]:
        """Commit tokens chosen by the policy; returns newly final generated token ids."""
        self.edited = []
        if self.revise is not None and self._first_row_fixed and not isinstance(logits, Proposal):
            plan, logits = self._with_first_row(plan, logits)
        if plan.targets.numel() == 0:
            if self.revise is not None and not self.settled:  # nothing left to read: the block is what it is
                self.settled = True
                return self._advance()
            return []
        if isinstance(logits, Proposal):  # greedy rows proposed on the device (engine/static_step.py)
            return self._commit(plan, *self._choose(logits, plan.targets, self.final_end), None)
        offsets = plan.targets - self.block_start
        if self.adjuster is not None:
            self.adjuster.adjust(logits)
        if self.dry is not None and int(plan.targets[0]) == self.final_end:  # its left context is all committed
            ids, penalty = dry_penalty(self.seq[: self.final_end], self.dry, self.dry_breakers)
            if ids.numel():
                logits[0, ids.to(logits.device)] -= penalty.to(logits.device, logits.dtype)
        logits[:, self.traits.mask_id] = float("-inf")  # never propose the mask itself (dInfer does the same)
        ban_early_stops(logits, plan.targets - self.P, self.params.min_tokens, self.stops)
        if self.constraint is not None:
            return self._apply_constrained(plan, logits, offsets)
        if self.revise is not None:
            return self._apply_revising(plan, logits)
        return self._commit(plan, *self._choose(logits, plan.targets, self.final_end), logits)

    def _commit(self, plan: StepPlan, d: Decision, commit: Tensor, logits: Tensor | None) -> list[int]:
        """Write the committed tokens and their bookkeeping; returns newly final token ids."""
        pos = plan.targets[commit]
        self.seq[pos] = d.tokens[commit]
        if self.adjuster is not None:
            self.adjuster.commit(d.tokens[commit])
        if self.logprobs is not None:
            self.logprobs[pos - self.P] = d.probs[commit].clamp_min(1e-30).log()
        if self.top is not None:
            self.top.record(pos - self.P, logits[commit], self.sampling.temperature)
        if bool(commit.any()):  # a Dream schedule with empty_steps may commit nothing
            self.stats.denoise_steps += 1
        return self._advance()

    def _choose(self, logits: Tensor, targets: Tensor, first_hole: int) -> tuple[Decision, Tensor]:
        """The policy's decision over the masked `targets` and the commit mask it leads to: the first token forced
        where the family writes it autoregressively, stop tokens deferred right of `first_hole` (ordered_stops)."""
        offsets = targets - self.block_start
        forced_first = self.traits.ar_first_token and self.block.step == 0 and int(offsets[0]) == 0  # before decide
        d = decide(self.policy, logits, offsets, self.block, self.sampling, self.generator)  # (which steps the block)
        commit = d.commit.clone()
        if forced_first:
            commit[0] = True
        if self.params.ordered_stops:
            commit = defer_late_stops(commit, d.tokens, targets, first_hole, self.stop_tensor)
        return d, commit

    def _record(self, pos: Tensor, tokens: Tensor, probs: Tensor, rows: Tensor) -> None:
        """Bookkeeping of tokens written at `pos`: penalties' counts, logprobs, top alternatives."""
        if self.adjuster is not None:
            self.adjuster.commit(tokens)
        if self.logprobs is not None:
            self.logprobs[(pos - self.P).cpu()] = probs.float().clamp_min(1e-30).log().cpu()
        if self.top is not None:
            self.top.record(pos - self.P, rows, self.sampling.temperature)

    def _apply_constrained(self, plan: StepPlan, logits: Tensor, offsets: Tensor) -> list[int]:
        """Grammar-constrained step: commits a run of tokens from the leftmost masked position on
        (unmask.structured.constraint explains the draft-verify rule), so the committed prefix never has holes
        and the matcher has read every committed token in order."""
        if int(plan.targets[0]) != self.final_end:
            raise RuntimeError(f"constrained decoding expects the first masked position at {self.final_end}, "
                               f"got {int(plan.targets[0])}")
        tokens, probs = self.constraint.step(logits, offsets, self.policy, self.block, self.sampling,
                                             self.generator, room=self.end - self.final_end)
        pos = plan.targets[: len(tokens)]
        self.seq[pos] = torch.tensor(tokens, dtype=torch.long)
        if self.adjuster is not None:
            self.adjuster.commit(self.seq[pos])
        if self.logprobs is not None:
            self.logprobs[pos - self.P] = torch.tensor(probs).clamp_min(1e-30).log()
        if self.top is not None:  # the constrained distribution: the constraint masked these rows in place
            self.top.record(pos - self.P, logits[: len(tokens)], self.sampling.temperature)
        self.stats.denoise_steps += 1
        return self._advance_constrained()

    def _advance_constrained(self) -> list[int]:
        """`_advance` after a constrained step: the finish reason the budget implies, and a schema's after-draft
        check on the finished answer (another attempt, or the error), before anything is released."""
        cache, status = self.cache, self.status   # finish() drops the cache; another attempt reuses the prompt's
        new = self._advance()
        c = self.constraint
        if self.finish_reason is not None:
            self.finish_reason = c.finish_reason(self.finish_reason)  # "length" whenever the budget ended it
        if not c.holds_back:
            return new
        # a schema with an after-draft check (unmask.structured.schema): nothing is released before it passes
        if self.finish_reason is None:
            return []
        if not c.complete():  # cut off by max_tokens: returned as it is, with finish_reason "length"
            return self.output_ids
        error = c.final_error(self.tokenizer_text())
        if error is None:
            return self.output_ids
        if c.retry():  # a whole new answer: the canvas starts over, the prompt's K/V are kept
            self._restart_constrained(cache, status)
            return []
        from unmask.errors import InvalidRequestError
        self.error = InvalidRequestError(
            f"{self.params.structured.param}: no answer of {c.attempts} attempts passed the schema's "
            f"after-draft check ({', '.join(c.relaxed) or 'duplicate keys'}): {error}", self.params.structured.param)
        return []

    def tokenizer_text(self) -> str:
        """The committed output as text (the constraint's tokenizer)."""
        return self.constraint.backend.tok.decode(self.output_ids, skip_special_tokens=False)

    def _restart_constrained(self, cache: KVCache | None, status: Status) -> None:
        """Another attempt at a constrained answer: fresh canvas, policy state and generator (next seed), same
        prompt; the cache keeps the K/V of the prompt blocks before the answer's first block."""
        keep = {k: getattr(self, k) for k in ("constraint", "dry_breakers", "stats", "cached")}
        seed = self.params.seed
        self.params = replace(self.params, seed=None if seed is None else seed + self.constraint.attempts - 1,
                              temperature=max(self.params.temperature, self.constraint.retry_temperature))
        self.__post_init__()
        for k, v in keep.items():
            setattr(self, k, v)
        self.status, self.finish_reason, self.stop_at, self.cache = status, None, None, cache
        if not self.bidirectional:
            self.cached = min(self.cached, self.block_start)
            if cache is not None:
                cache.truncate(self.cached)

    def _advance(self) -> list[int]:
        """Extend the final prefix over what is committed; finish at a stop token or the end; move past
        complete blocks (a block decoded while the one before was open may be complete already)."""
        if not self.settled:  # revising: the active block may still change, so nothing in it is final yet
            if self.sub is not None and self._window()[0] != self.window_start:
                self._open_window()
            return []
        mask = self.traits.mask_id
        new: list[int] = []
        while True:
            old = self.final_end
            tail = self.seq[old:min(self.block_end, self.end)]  # positions past max_tokens are never output
            holes = (tail == mask).nonzero()
            self.final_end = old + (int(holes[0]) if holes.numel() else tail.numel())
            got = self.seq[old:self.final_end].tolist()
            for i, t in enumerate(got):
                if t in self.stops:
                    self.stop_at = old + i
                    self.final_end = self.stop_at
                    self.finish("stop")
                    return new + got[:i]
            new += got
            if self.final_end >= self.end:
                self.finish("length")
                return new
            if self.final_end < self.block_end:
                break
            # block complete: move on; its K/V are written next step
            self.block_start, self.block_end = self.block_end, min(self.block_end + self.B, self.canvas_end)
            self._open_window()
            self._new_block()
        if self.sub is not None and self._window()[0] != self.window_start:
            self._open_window()  # sub-block complete: the next one starts its own schedule
        return new

    def finish(self, reason: str) -> None:
        self.status, self.finish_reason = Status.FINISHED, reason
        self.cache = None

    # ------------------------------------------------------------------ views
    @property
    def output_ids(self) -> list[int]:
        return self.seq[self.P:self.final_end].tolist()

    def snapshot(self) -> list[int]:
        """The committed prefix plus the active block (and an open next block) as it stands, masks included."""
        return self.seq[self.P:min(self.view_end(), self.end)].tolist()

    @property
    def num_generated(self) -> int:
        return self.final_end - self.P
