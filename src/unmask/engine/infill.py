"""Infilling: generate the middle between a prefix and a suffix.

The family decides how:

  masked span (bidirectional: LLaDA, Dream)
      canvas = [prefix | L masks | suffix]. Every step feeds the whole canvas (exact, no cache), so the
      span is denoised with both sides in view; the suffix tokens are never targets and never change
      (`Sequence` keeps them at [end, end + S)). The span ends early where the model commits an end
      token (EOS / end of turn): the middle is the text before it.
  fill-in-the-middle tokens (block-causal: the built-in unmask family, SDAR, Fast-dLLM v2, LLaDA2)
      prompt = <|fim_prefix|>P<|fim_suffix|>S<|fim_middle|> (PSM order, no BOS), the format the
      built-in model is trained on (unmask.train.sft); the model writes the middle and ends it with
      EOS, an ordinary stop token. A block-causal model cannot see a suffix placed after its span, so
      families whose tokenizer lacks these tokens are refused with an error naming them.

Span length (masked span only). A wrong fixed length costs much accuracy (the model must cram or pad
the middle), so the length is chosen by the model. `InfillSequence` first feeds one canvas per
candidate length L_1 < ... < L_K (default 2, 4, 8, ... up to max_tokens, at most 8) as separate
segments of ONE batched forward, and reads for each candidate:

  end_prob  the probability of an end token at the span's last position: the model says "the middle
            is over before here", i.e. the span has room;
  score     the mean log top-1 probability over the span's first block and its last block (the two
            edges that must join the prefix and the suffix): how sure the model is of a fill this long.

`choose_length`: the shortest candidate with end_prob >= END_THRESHOLD; if none has room, the one
with the best score (ties: the longer). The winner's first-block logits from that same forward are
its first denoising step, so probing costs no extra forward, only the wider one. Denoising then
continues on the chosen span as usual and stops at the natural end: an end token committed inside
the span, or the span filled (finish_reason "stop"; "length" only when the span is max_tokens).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from unmask.decoding import BlockState
from unmask.engine.params import GenerationParams
from unmask.engine.sequence import Sequence, StepPlan
from unmask.errors import ContextLengthError, InvalidRequestError
from unmask.models.attention import Segment

FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
MIN_CANDIDATE = 2          # shortest default candidate length (mid-line infills are often 1-3 tokens)
MAX_CANDIDATES = 8         # canvases per probe forward
END_THRESHOLD = 0.5        # end-token probability at the span's last position that means "room left"


# ---------------------------------------------------------------------------------------- length choice
def candidate_lengths(max_tokens: int) -> list[int]:
    """Powers of two from MIN_CANDIDATE below max_tokens, plus max_tokens; the longest MAX_CANDIDATES."""
    out, n = [], MIN_CANDIDATE
    while n < max_tokens:
        out.append(n)
        n *= 2
    out.append(max_tokens)
    return out[-MAX_CANDIDATES:]


@dataclass(frozen=True)
class ProbeStat:
    length: int
    end_prob: float   # p(end token) at the span's last position
    score: float      # mean log top-1 probability over the span's first and last blocks


def choose_length(stats: list[ProbeStat], threshold: float = END_THRESHOLD) -> int:
    """The shortest candidate the model gives room (end_prob >= threshold), else the best-scoring one.

    The winner among a subset is never beaten later by a candidate that lost to that subset, so the
    rule can run as candidates arrive and only the current winner's logits need keeping."""
    roomy = [s for s in stats if s.end_prob >= threshold]
    if roomy:
        return min(roomy, key=lambda s: s.length).length
    return max(stats, key=lambda s: (s.score, s.length)).length


@dataclass
class ProbePlan(StepPlan):
    length: int = 0     # the candidate span length this canvas holds
    n_first: int = 0    # leading rows of `targets` that are the span's first block


class InfillSequence(Sequence):
    """A masked-span request whose span length is chosen by a one-forward probe (see the module doc)."""

    def __post_init__(self):
        super().__post_init__()
        self.cache_mode = "none"   # the probe's first step wrote no cache: decode exactly from there on
        # a span shorter than min_tokens cannot hold them: such candidates are not probed
        lengths = [n for n in (self.params.infill_lengths or []) if n >= self.params.min_tokens]
        self.lengths = lengths or [self.params.max_tokens]
        self.probe_stats: list[ProbeStat] = []
        self.span_length: int | None = None
        self._kept: Tensor | None = None       # first-block logits of the current winner
        if len(self.lengths) == 1:
            self._set_span(self.lengths[0])

    @property
    def probing(self) -> bool:
        return self.span_length is None

    def plan(self, token_budget: int) -> StepPlan | list[StepPlan]:
        if self.probing:
            return [self._probe_plan(n) for n in self.lengths]
        return super().plan(token_budget)

    def _probe_plan(self, n: int) -> ProbePlan:
        P, S, B = self.P, self.S, self.B
        ids = torch.cat([self.seq[:P], torch.full((n,), self.traits.mask_id, dtype=torch.long),
                         self.seq[self.end:self.end + S]])
        first = min(B, n)
        offsets = torch.cat([torch.arange(first), torch.arange(max(first, n - B), n)])
        targets = P + offsets
        rows = targets - int(self.traits.shift)   # P >= 1: a shifted family reads row P-1 for position P
        seg = Segment(start=0, length=P + n + S)
        return ProbePlan(self, ids, torch.arange(P + n + S), seg, rows, targets, length=n, n_first=first)

    def after_forward(self, plan: StepPlan) -> None:
        if isinstance(plan, ProbePlan):
            self.stats.forwards += plan.length == self.lengths[0]  # K canvases, one forward
            return
        super().after_forward(plan)

    def apply(self, plan: StepPlan, logits: Tensor) -> list[int]:
        if not isinstance(plan, ProbePlan):
            return super().apply(plan, logits)
        logits[:, self.traits.mask_id] = float("-inf")
        scored = logits
        if self.adjuster is not None:  # logit_bias steers the choice too (penalties are 0: no output yet);
            scored = logits.clone()    # the kept rows are adjusted once, by the first denoising step
            self.adjuster.adjust(scored)
        logp = scored.float().log_softmax(-1)
        stops = sorted(t for t in self.stops if t < logp.shape[1])
        # an end token at output position length-1 is banned while min_tokens are not yet out
        end_ok = stops and plan.length - 1 >= self.params.min_tokens
        end_prob = float(logp[-1, stops].exp().sum()) if end_ok else 0.0
        self.probe_stats.append(ProbeStat(plan.length, end_prob, float(logp.max(-1).values.mean())))
        if choose_length(self.probe_stats) == plan.length:
            self._kept = logits[:plan.n_first].clone()
        if len(self.probe_stats) < len(self.lengths):
            return []
        self._set_span(choose_length(self.probe_stats))
        kept, self._kept = self._kept, None
        targets = self.masked_positions()
        step = StepPlan(self, self.seq[:0], targets, Segment(start=0, length=0), targets - self.P, targets)
        return super().apply(step, kept)   # the winner's first denoising step, from the probe forward

    def _set_span(self, n: int) -> None:
        """Resize the (still fully masked) span to n tokens; the suffix moves right after it."""
        suffix = self.seq[self.end:self.end + self.S].clone()
        self.span_length = n
        self.end = self.P + n
        seq = torch.full((self.end + self.S,), self.traits.mask_id, dtype=torch.long)
        seq[:self.P] = self.seq[:self.P]
        seq[self.end:] = suffix
        self.seq = seq
        self.block_end = min(self.block_start + self.B, self.end)
        self.block = BlockState(initial_masked=self._masked_in_block())

    def finish(self, reason: str) -> None:
        if reason == "length" and self.span_length is not None and self.span_length < self.params.max_tokens:
            reason = "stop"  # the model sized this span itself and filled it: a complete middle
        super().finish(reason)


# ---------------------------------------------------------------------------------------- prompts
@dataclass
class InfillPrompt:
    mode: str                  # "masked_span" | "fim_tokens"
    prompt_ids: list[int]
    suffix_ids: list[int]      # masked_span: the tokens after the span; fim_tokens: [] (they are in the prompt)
    dropped: tuple[int, int]   # prefix / suffix tokens left out to fit the context


def infill_mode(spec, tokenizer) -> str:
    """How this model infills ("masked_span" | "fim_tokens"); InvalidRequestError (param suffix) if it cannot."""
    fam = spec.family
    if fam.sequence_class is None and fam.attention == "bidirectional":
        return "masked_span"
    if fam.sequence_class is None and fam.attention == "block_causal":
        missing = [t for t in FIM_TOKENS if tokenizer.token_id(t) is None]
        if missing:
            raise InvalidRequestError(
                f"this model ({fam.name} family, block-causal) cannot fill in the middle: its tokenizer has no "
                f"fill-in-the-middle tokens (missing {', '.join(missing)}), and a block-causal model cannot "
                "attend to a suffix placed after the span", "suffix")
        return "fim_tokens"
    raise InvalidRequestError(f"fill in the middle is not supported for the {fam.name} family", "suffix")


def fit_context(prefix: list[int], suffix: list[int], limit: int) -> tuple[list[int], list[int]]:
    """Keep the tokens nearest the span: the prefix's tail and the suffix's head, prefix first but at
    least a third of `limit` for the suffix when both are long."""
    if len(prefix) + len(suffix) <= limit:
        return prefix, suffix
    keep_s = min(len(suffix), max(limit - len(prefix), limit // 3))
    keep_p = min(len(prefix), limit - keep_s)
    return prefix[len(prefix) - keep_p:], suffix[:keep_s]


def build_infill(tokenizer, spec, prefix: str | list[int], suffix: str | list[int], limit: int) -> InfillPrompt:
    """Prompt (and suffix) of an infill request; `limit`: tokens the prompt and suffix may take together."""
    mode = infill_mode(spec, tokenizer)
    # the prefix and suffix are the user's file: control-token text in it stays text (token ids pass as given)
    pre = tokenizer.encode(prefix, parse_special=False) if isinstance(prefix, str) else list(prefix)
    suf = tokenizer.encode(suffix, parse_special=False) if isinstance(suffix, str) else list(suffix)
    n_pre, n_suf = len(pre), len(suf)
    if mode == "fim_tokens":
        fp, fs, fm = (tokenizer.token_id(t) for t in FIM_TOKENS)
        if limit - 3 < 0:
            raise ContextLengthError("no room left in the context for the prefix and suffix", "max_tokens")
        pre, suf = fit_context(pre, suf, limit - 3)
        return InfillPrompt(mode, [fp, *pre, fs, *suf, fm], [], (n_pre - len(pre), n_suf - len(suf)))
    head: list[int] = []
    if not pre:  # the canvas needs a first token (a shifted family predicts position i from i-1)
        bos = tokenizer.hf.bos_token_id
        if bos is None:
            raise InvalidRequestError("the prefix (prompt) is empty and this model has no BOS token to start "
                                      "the canvas with; send at least one character of prefix", "prompt")
        head = [bos]
    if limit - len(head) < 1:
        raise ContextLengthError("no room left in the context for the prefix and suffix", "max_tokens")
    pre, suf = fit_context(pre, suf, limit - len(head))  # keeps at least one prefix token when there is one
    return InfillPrompt(mode, head + pre, suf, (n_pre - len(pre), n_suf - len(suf)))


def infill_params(prompt: InfillPrompt, params: GenerationParams, lengths: list[int] | None = None) -> GenerationParams:
    """The engine parameters of an infill: masked spans carry the suffix and the candidate lengths
    (none under a grammar constraint, whose end closes the span); FIM-token prompts need nothing."""
    if prompt.mode != "masked_span":
        return params
    if params.structured is not None:
        return replace(params, suffix_ids=list(prompt.suffix_ids), infill_lengths=None)
    if lengths is not None:  # the caller's own candidates: GenerationParams checks their range
        return replace(params, suffix_ids=list(prompt.suffix_ids), infill_lengths=list(lengths))
    cands = [n for n in candidate_lengths(params.max_tokens) if params.min_tokens <= n <= params.max_tokens]
    return replace(params, suffix_ids=list(prompt.suffix_ids), infill_lengths=cands or [params.max_tokens])


def infill(llm, prefix: str, suffix: str, params: GenerationParams | None = None,
           lengths: list[int] | None = None):
    """Offline API: the middle between `prefix` and `suffix` (a RequestOutput; `.text` is the middle)."""
    params = params or GenerationParams()
    limit = llm.spec.max_context - params.max_tokens
    prompt = build_infill(llm.tokenizer, llm.spec, prefix, suffix, limit)
    return llm.generate([prompt.prompt_ids], infill_params(prompt, params, lengths))[0]
