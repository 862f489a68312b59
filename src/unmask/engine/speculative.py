"""Self-speculative decoding (policy `speculative`): draft in diffusion, accept autoregressively, one forward a step.

For block-causal models with a causal context (committed text read token-causally, every clean row a trained
next-token predictor: the built-in family). Each forward feeds, after the exact cache:

    T  committed tokens not yet cached (the last one at least: its row predicts the next token)   token-causal
    D  the drafts of the last step, d_0..d_{k-1}, at the next k positions                           token-causal
    M  draft blocks of K masks: block j starts where the token after j kept drafts will go, sees
       T and d_0..d_{j-1}, and itself bidirectionally (j = k only, or j = 0 where the only drafts are the
       n-gram table's; with `all outcomes` also every j up to the number of diffusion drafts)

The rows of T's last token and of D are the verifier (decoding.speculative.verify): they keep a prefix of D and
add one token of their own, so a step writes 1 to k + 1 tokens, exactly those one-token-per-forward next-token
decoding writes. Block j's rows 0..K-2 are the next step's drafts (row i predicts the token after position i:
the shifted families' rule), used when j drafts were kept; without a block for that outcome the next step has
no drafts and writes one token. The K/V of T and of the kept drafts are exact and stay; the rest are scratch
that the next step overwrites (`cached` moves back to the first position whose K/V are not exact).

With `draft_lookup`, greedy and no logit adjustments, a step whose diffusion drafts disagree with a copy of the
committed text (decoding.speculative.lookup_drafts on the text alone) verifies both: after M come the copy C and
its own draft block, C token-causal over T, and the branch that keeps more drafts wins (the diffusion one on a
tie). The output is still exactly next-token decoding; a won copy's K/V were not written, so its tokens are fed
again next step as committed ones. Where the text has no earlier match, a model that ships an n-gram table of its
training text (decoding.ngram_drafts; `draft_ngrams`) drafts from that instead, in both places a copy goes; and in a
step without diffusion drafts whose drafts are a prompt-lookup copy, the table's draft is the second chain.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from unmask.decoding import ngram_drafts
from unmask.decoding.dry import dry_penalty
from unmask.decoding.logit_adjust import ban_early_stops
from unmask.decoding.ngram_drafts import FILE, NgramTable, TableMismatch, tokenizer_digest
from unmask.decoding.sampling import row_argmax
from unmask.decoding.speculative import draw, lookup_drafts, processed_probs, verify
from unmask.engine.sequence import Sequence, StepPlan
from unmask.errors import InvalidRequestError, ModelLoadError
from unmask.models.attention import Segment


# a copied run is looked up only after a match of 2+ tokens: a wrong copy also moves the next draft block past it
# (the block sits after all drafts), and one-token matches were wrong often enough to cost more than they saved
# (built-in model, 20 held-out function bodies / next lines, quiet 2-core VM, a scratch copy of
# bench/speculative_lookup.py: 1.18x / 1.02x the tokens/s without lookup at 1 token, 1.33x / 1.13x at 2)
LOOKUP_MIN_NGRAM = 2


def speculative_refusal(params, traits, family_class) -> tuple[str, str] | None:
    """Why a request cannot run under the `speculative` policy on this model, as (message, param); None if it can."""
    if not (traits.attention == "block_causal" and traits.shift and traits.causal_context and family_class is None):
        return (f"policy 'speculative' verifies drafts with the model's next-token rows: it needs a block-causal "
                f"model with a causal context trained with a next-token loss (the built-in family), not "
                f"{traits.family}", "policy")
    unsupported = [name for name, on in (
        ("edit_threshold", params.edit_config().active),
        ("multi_block_threshold", params.multi_block_threshold is not None),
        ("small_block_size", params.small_block_size is not None),
    ) if on]
    if unsupported:
        return f"policy 'speculative' cannot be combined with {unsupported[0]} (use another policy)", "policy"
    if params.draft_ngrams and traits.ngram_drafts is None:
        return (f"draft_ngrams: this model has no n-gram draft table ({FILE} beside its weights; `unmask "
                "ngram-drafts` counts one from its training text)", "draft_ngrams")
    return None


def load_ngram_drafts(spec) -> NgramTable | None:
    """The checkpoint's n-gram draft table (decoding.ngram_drafts), checked against its vocabulary and tokenizer;
    None where it has none. A table that does not belong to the model stops the load with one line."""
    path = spec.path / FILE
    if not path.is_file():
        return None
    tok = spec.path / "tokenizer.json"
    try:
        return ngram_drafts.load(path, spec.arch.vocab_size, tokenizer_digest(tok) if tok.is_file() else None)
    except TableMismatch as e:
        raise ModelLoadError(str(e)) from e


def check_speculative(params, traits, family_class) -> None:
    """InvalidRequestError unless a request for the `speculative` policy can run on this model as asked."""
    refusal = speculative_refusal(params, traits, family_class)
    if refusal:
        raise InvalidRequestError(*refusal)


def _common_prefix(a: Tensor, b: Tensor) -> int:
    n = min(int(a.numel()), int(b.numel()))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


def draft_layout(n_committed: int, n_drafts: int, block_lengths: list[int], outcomes: list[int]) -> Tensor:
    """[L, L] bool: which of the step's own tokens each one sees. T (n_committed) and D (n_drafts) are token-causal;
    the draft block for outcome j sees T, the first j drafts and itself."""
    n_clean = n_committed + n_drafts
    L = n_clean + sum(block_lengths)
    attend = torch.zeros(L, L, dtype=torch.bool)
    attend[:n_clean, :n_clean] = torch.ones(n_clean, n_clean, dtype=torch.bool).tril()
    s = n_clean
    for j, k in zip(outcomes, block_lengths):
        attend[s:s + k, :n_committed + j] = True
        attend[s:s + k, s:s + k] = True
        s += k
    return attend


def with_branch(attend: Tensor, n_committed: int, n_alt: int, block: int) -> Tensor:
    """`attend` grown by a second draft chain of n_alt tokens (token-causal, over T only) and its draft block of
    `block` masks (over T, the chain and itself), after everything `attend` already lays out."""
    L0 = attend.shape[0]
    L = L0 + n_alt + block
    out = torch.zeros(L, L, dtype=torch.bool)
    out[:L0, :L0] = attend
    out[L0:, :n_committed] = True
    out[L0:L0 + n_alt, L0:L0 + n_alt] = torch.ones(n_alt, n_alt, dtype=torch.bool).tril()
    out[L0 + n_alt:, L0:L] = True
    return out


# a step's layout depends only on a few counts, which repeat from step to step: the small ones are kept (a decoding
# step's; a prompt's first forward, with hundreds of committed tokens, is built each time)
_LAYOUT_CACHE_MAX_COMMITTED = 64


def step_layout(n_committed: int, n_drafts: int, block_lengths: tuple[int, ...], outcomes: tuple[int, ...],
                branch: tuple[int, int] | None) -> Tensor:
    """draft_layout, grown by `with_branch(*branch)` where a second chain is verified; shared, read-only."""
    if n_committed > _LAYOUT_CACHE_MAX_COMMITTED:
        return _build_layout(n_committed, n_drafts, block_lengths, outcomes, branch)
    return _cached_layout(n_committed, n_drafts, block_lengths, outcomes, branch)


def _build_layout(n_committed, n_drafts, block_lengths, outcomes, branch) -> Tensor:
    attend = draft_layout(n_committed, n_drafts, list(block_lengths), list(outcomes))
    return attend if branch is None else with_branch(attend, n_committed, *branch)


_cached_layout = functools.lru_cache(maxsize=512)(_build_layout)


class SpeculativeSequence(Sequence):
    """A request decoded by the `speculative` policy (module docstring). The canvas holds the committed text and
    masks after it; the drafts live beside it until the verifier keeps them."""

    def __post_init__(self):
        super().__post_init__()
        self.sub = self.multi = None          # the draft block is the unit: no sub-blocks, no second open block
        self.block_end = self.canvas_end      # `_advance` then only extends the committed prefix
        self.K = self.B
        self.all_outcomes = bool(self.params.draft_all_outcomes)
        self.drafts = torch.empty(0, dtype=torch.long)
        self.draft_probs: Tensor | None = None  # [k, V] the distributions drafts were drawn from (sampling only)
        self._blocks: dict[int, tuple[int, int]] = {}  # outcome j -> (first logit row of its drafts, count)
        self.drafted = 0   # drafts offered to the verifier, and kept: the acceptance rate in stats
        self.kept = 0
        self.lookup = int(self.params.draft_lookup or 0)
        # where the copy finds no match, the model's n-gram table drafts (draft_ngrams; None: on where there is one)
        self.ngrams: NgramTable | None = None if self.params.draft_ngrams is False else self.traits.ngram_drafts
        self._from_table = False   # whether the last `_copied` drafted from the table (prompt lookup found nothing)
        self._step_drafts = self.drafts  # this step's: `drafts` (the diffusion rows'), then any copied ones
        self._alt = self.drafts          # this step's second chain: a copy of the committed text (module docstring)
        self._alt_rows = (0, 0)          # its verifier rows (first logit row, count) after T's last row
        self._alt_block = (0, 0)         # its draft block's rows
        self.copy_wins = 0               # steps where the copy kept more drafts than the diffusion chain

    @property
    def prefill_limit(self) -> int:
        """The last committed token is fed with the drafts (its row predicts the first one): whole prompt blocks
        before it may come from the prefix cache or a write-only chunk."""
        return max(0, (self.P - 1) // self.B * self.B)

    def plan(self, token_budget: int) -> StepPlan:
        f, c = self.final_end, self.cached
        pending = f - c
        if pending > token_budget:  # chunked prefill: whole blocks, write only, never the last committed token
            n = min(max(self.B, token_budget // self.B * self.B), (f - 1 - c) // self.B * self.B)
            if n > 0:  # token-causal by block ids, one a token: the kernels' causal path, no [n, n] mask
                seg = Segment(start=c, length=n, write=n, cache=self.cache, block_ids=torch.arange(c, c + n))
                empty = torch.empty(0, dtype=torch.long)
                return StepPlan(self, self.seq[c:c + n], torch.arange(c, c + n), seg, empty, empty)
        self._step_drafts = self._drafts_for_step(f)
        k = min(int(self._step_drafts.numel()), self.end - f - 1)  # the verifier's own token fits before the end
        drafts = self._step_drafts[:k]
        outcomes = self._outcomes(k)
        lengths = [min(self.K, self.end - (f + j)) for j in outcomes]
        n_clean = pending + k
        ids = [self.seq[c:f], drafts] + [torch.full((n,), self.traits.mask_id, dtype=torch.long) for n in lengths]
        pos = [torch.arange(c, f + k)] + [torch.arange(f + j, f + j + n) for j, n in zip(outcomes, lengths)]
        rows = [torch.arange(pending - 1, n_clean)]   # verifier rows: targets f .. f + k
        targets = [torch.arange(f, f + k + 1)]
        self._blocks, s, r = {}, n_clean, k + 1
        for j, n in zip(outcomes, lengths):
            m = max(0, min(n - 1, self.end - (f + j) - 1))  # row i predicts position f + j + i + 1
            rows.append(torch.arange(s, s + m))
            targets.append(torch.arange(f + j + 1, f + j + 1 + m))
            self._blocks[j] = (r, m)
            s, r = s + n, r + m
        self._alt = alt = self._second_chain(f, drafts)
        branch = None
        if alt.numel():  # C at f.., then its block: rows for C's tokens and the block's first n - 1
            kb = int(alt.numel())
            n = min(self.K, self.end - (f + kb))
            m = max(0, min(n - 1, self.end - (f + kb) - 1))
            ids += [alt, torch.full((n,), self.traits.mask_id, dtype=torch.long)]
            pos += [torch.arange(f, f + kb), torch.arange(f + kb, f + kb + n)]
            rows += [torch.arange(s, s + kb), torch.arange(s + kb, s + kb + m)]
            targets += [torch.arange(f + 1, f + kb + 1), torch.arange(f + kb + 1, f + kb + 1 + m)]
            self._alt_rows, self._alt_block = (r, kb), (r + kb, m)
            branch = (kb, n)
            s += kb + n
        attend = step_layout(pending, k, tuple(lengths), tuple(outcomes), branch)
        seg = Segment(start=c, length=s, write=n_clean, cache=self.cache, attend=attend, causal_prefix=n_clean)
        self._k = k
        return StepPlan(self, torch.cat(ids), torch.cat(pos), seg, torch.cat(rows), torch.cat(targets))

    def _outcomes(self, k: int) -> list[int]:
        """How many of the k drafts a draft block is placed after: all k, and with `all outcomes` also every count
        of the diffusion drafts (0 .. their number): a refusal among them still leaves the next step drafts. Copied
        drafts after them get no blocks of their own (a block costs K rows; a wrong copy then writes one token).
        A step whose only drafts are the n-gram table's places its one block after none of them instead: the
        table's first draft is refused more often than its whole run is kept, and the block then gives the next
        step diffusion drafts (the 5.25M drafter, float32, every held-out task: 2.60 -> 2.68 tokens per decoding
        forward on next lines, 2.31 -> 2.35 infills, 4.23 -> 4.32 function bodies, the same rows a step;
        bench/speculative_steps.py)."""
        if not self.all_outcomes:
            if k and self._from_table and not self.drafts.numel():
                return [0]
            return [k]
        diffusion = min(int(self.drafts.numel()), k)
        return sorted(set(range(diffusion + 1)) | {k})

    def _second_chain(self, f: int, drafts: Tensor) -> Tensor:
        """A copy of the committed text to verify beside diffusion drafts it disagrees with (module docstring);
        in a step without diffusion drafts, whose drafts are then a prompt-lookup copy, the n-gram table's draft
        beside it. Empty where there is none, it drafts what the step already does, or it cannot be weighed
        exactly (sampling, logit adjustments, DRY); under a grammar its rows are masked as the step's are."""
        empty = drafts[:0]
        if (not self.lookup or not drafts.numel() or not self.sampling.greedy or self.adjuster is not None
                or self.dry is not None):  # its rows get no penalty
            return empty
        if min(int(self.drafts.numel()), int(drafts.numel())):
            copy = self._copied(self.seq[:f])
        elif self.ngrams is not None and not self._from_table:   # the step's drafts are a prompt-lookup copy of
            copy = self._table_drafts(self.seq[:f])               # this same text (`_drafts_for_step`, just before)
        else:
            return empty
        copy = copy[:max(0, self.end - f - 1)]
        n = min(int(copy.numel()), int(drafts.numel()))
        if not n or torch.equal(copy[:n], drafts[:n]):  # the step's chain already drafts what the copy would
            return empty
        return copy

    def _drafts_for_step(self, f: int) -> Tensor:
        """The diffusion rows' drafts (from the last step), then, with `draft_lookup`, up to that many tokens copied
        from an earlier occurrence of the text's last n-gram, drafts included (decoding.speculative.lookup_drafts):
        a copied draft costs a verifier row, never the output."""
        if not self.lookup:
            return self.drafts
        more = self._copied(torch.cat([self.seq[:f], self.drafts]))
        return torch.cat([self.drafts, more])

    def _copied(self, ids: Tensor) -> Tensor:
        """Up to `lookup` drafts continuing `ids`: copied from an earlier occurrence of its last tokens (prompt
        lookup), else, with an n-gram table, what most often followed them in the model's training text."""
        copy = lookup_drafts(ids, self.lookup, min_ngram=LOOKUP_MIN_NGRAM)
        self._from_table = not copy.numel() and self.ngrams is not None
        return self._table_drafts(ids) if self._from_table else copy

    def _table_drafts(self, ids: Tensor) -> Tensor:
        return torch.tensor(self.ngrams.draft(ids[-self.ngrams.max_n:].tolist(), self.lookup), dtype=torch.long)

    def after_forward(self, plan: StepPlan) -> None:
        self.stats.forwards += 1
        seg = plan.segment
        self.stats.prefill_tokens += max(0, min(seg.start + seg.write, self.P) - seg.start)
        if plan.targets.numel() == 0:  # a write-only prefill chunk
            self.cached = seg.start + seg.write

    def apply(self, plan: StepPlan, logits: Tensor) -> list[int]:
        if plan.targets.numel() == 0:
            return []
        f, k = self.final_end, self._k
        drafts = self._step_drafts[:k]
        logits[:, self.traits.mask_id] = float("-inf")
        if f - self.P < self.params.min_tokens:  # every target is at f or later
            ban_early_stops(logits, plan.targets - self.P, self.params.min_tokens, self.stops)
        if self.adjuster is not None:  # verifier row i follows drafts 0..i-1: counted as if committed
            self.adjuster.adjust_causal(logits[:k + 1], drafts)
            self.adjuster.adjust(logits[k + 1:])  # the draft rows: only what is committed (drafts need not be exact)
        if self.dry is not None:  # DRY the same way: row i's left context is the committed text and drafts 0..i-1
            context = torch.cat([self.seq[:f], drafts])
            for i in range(k + 1):
                ids, penalty = dry_penalty(context[:f + i], self.dry, self.dry_breakers)
                if ids.numel():
                    logits[i, ids.to(logits.device)] -= penalty.to(logits.device, logits.dtype)
        greedy = self.sampling.greedy
        verifier = logits[:k + 1]
        if self.constraint is not None:  # each row masked as constrained next-token decoding masks it there
            drafts, verifier = self._grammar_chain(drafts, verifier)
            k = int(drafts.numel())
        # greedy: the argmax of the logits is the rule's whole input (no [k + 1, V] one-hot on the step's path)
        target = verifier if greedy else processed_probs(verifier, self.sampling)
        verdict = verify(drafts, None if greedy or k == 0 else self._step_draft_probs(k, logits), target, greedy,
                         self.generator)
        offered, block = k, self._blocks.get(verdict.accepted)
        won_copy = False
        if self._alt.numel():  # greedy only: the copy's verifier rows are T's last one and its own
            r, kb = self._alt_rows
            rows, alt = torch.cat([verifier[:1], logits[r:r + kb]]), self._alt
            if self.constraint is not None:  # its rows masked as the diffusion chain's are (row 0 is shared)
                alt, rows = self._grammar_chain(alt, rows)
            other = verify(alt, None, rows, True, None)
            offered += kb
            if other.accepted > verdict.accepted:  # its block sits after the whole copy
                won_copy, verdict, verifier = True, other, rows
                self.copy_wins += 1
                block = self._alt_block if other.accepted == kb else None
        a = verdict.accepted
        n = min(a + 1, self.end - f)
        tokens = out = verdict.tokens[:n].cpu()
        if self.constraint is not None:  # then the text the grammar forces, and the budget (may cut or replace)
            out = torch.tensor(self.constraint.commit_chain(tokens.tolist(), self.end - f), dtype=torch.long)
        m = int(out.numel())
        same = n if out is tokens else _common_prefix(out, tokens)   # the verifier's own tokens that stay
        self.seq[f:f + m] = out
        if self.adjuster is not None:
            self.adjuster.commit(out)
        self.drafted, self.kept = self.drafted + offered, self.kept + min(a, same)
        self._record_outputs(torch.arange(f, f + m), out, verifier[:same])
        self.stats.denoise_steps += 1
        # exact K/V: the committed tokens fed and the drafts kept; the verifier's own token is fed next step (a won
        # copy's K/V were not written: its tokens are fed again; forced tokens are fed next step too)
        self.cached = f if won_copy else f + min(a, same)
        if self.cache is not None:
            self.cache.length = min(self.cache.length, self.cached)
        self._next_drafts(logits, block if same == n else None, after=out[n:])
        return self._advance() if self.constraint is None else self._advance_constrained()

    def _grammar_chain(self, drafts: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
        """A chain's drafts and verifier rows under the grammar: cut after the last draft it accepts in order (a
        later one cannot be kept), the rows masked in place (Constraint.chain_masks)."""
        masks = self.constraint.chain_masks(drafts.tolist())
        rows = rows[:len(masks)]
        rows.masked_fill_(~torch.stack(masks).to(rows.device), float("-inf"))
        return drafts[:len(masks) - 1], rows

    def _step_draft_probs(self, k: int, logits: Tensor) -> Tensor:
        """[k, V]: the law each draft was drawn from; a copied draft is certain (one-hot), so speculative sampling
        keeps it with the verifier's probability of it and else draws from the verifier's law without it."""
        n = min(int(self.drafts.numel()), k)  # the diffusion drafts come first
        if n == k:
            return self.draft_probs[:k]
        q = torch.nn.functional.one_hot(self._step_drafts[:k].to(logits.device), logits.shape[1]).float()
        if n:
            q[:n] = self.draft_probs[:n]
        return q

    def _record_outputs(self, pos: Tensor, tokens: Tensor, rows: Tensor) -> None:
        """Logprobs and top alternatives of the written tokens under the verifier's distribution (rows: the
        verifier's, for the first of them; a token the grammar forced or the budget wrote is certain: 0)."""
        if self.logprobs is None and self.top is None:
            return
        if rows.shape[0] < tokens.numel():
            certain = torch.full((tokens.numel() - rows.shape[0], rows.shape[1]), float("-inf"), device=rows.device,
                                 dtype=rows.dtype)
            certain[torch.arange(certain.shape[0]), tokens[rows.shape[0]:].to(rows.device)] = 0.0
            rows = torch.cat([rows, certain])
        if self.logprobs is not None:
            if self.sampling.greedy:
                lp = torch.log_softmax(rows.float(), dim=-1)
            else:
                lp = processed_probs(rows, self.sampling).clamp_min(1e-30).log()
            self.logprobs[pos - self.P] = lp.gather(1, tokens[:, None].to(lp.device)).squeeze(1).cpu()
        if self.top is not None:
            self.top.record(pos - self.P, rows, self.sampling.temperature)

    def _next_drafts(self, logits: Tensor, block: tuple[int, int] | None, after: Tensor | None = None) -> None:
        """The next step's diffusion drafts: the rows of `block`, the draft block placed after exactly the
        tokens this step kept (None: no block sits there). `after`: tokens written past them this step (forced by
        a grammar): the drafts then start after those, where they drafted the same tokens, else there are none."""
        empty = torch.empty(0, dtype=torch.long)
        if block is None or block[1] == 0:
            self.drafts, self.draft_probs = empty, None
            return
        r, m = block
        if self.sampling.greedy:
            self.drafts, self.draft_probs = row_argmax(logits[r:r + m].cpu()), None
        else:
            q = processed_probs(logits[r:r + m], self.sampling)
            self.drafts, self.draft_probs = draw(q, self.generator).cpu(), q
        e = 0 if after is None else int(after.numel())
        if e:
            if self.drafts.numel() > e and torch.equal(self.drafts[:e], after):
                self.drafts = self.drafts[e:]
                self.draft_probs = None if self.draft_probs is None else self.draft_probs[e:]
            else:
                self.drafts, self.draft_probs = empty, None

    def _restart_constrained(self, cache, status) -> None:
        """Another attempt at a constrained answer: as the base class, and the prompt's last token fed again (its
        row predicts the answer's first token)."""
        super()._restart_constrained(cache, status)
        self.cached = min(self.cached, self.P - 1)
        if self.cache is not None:
            self.cache.truncate(self.cached)

    def snapshot(self) -> list[int]:
        """The committed output and the draft block's positions, masked: a draft is not committed until the
        verifier keeps it (a frame that showed drafts as text would call a refused one committed)."""
        return self.output_ids + [self.traits.mask_id] * max(0, min(self.K, self.end - self.final_end))
