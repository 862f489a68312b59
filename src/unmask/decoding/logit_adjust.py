"""Per-request logit adjustments: OpenAI's `logit_bias`, `presence_penalty`, `frequency_penalty`, and
the `repetition_penalty` of vLLM and transformers.

    logits[j] = rep(logits[j] + bias[j]) - frequency_penalty * count[j] - presence_penalty * (count[j] > 0)

with count[j] = how often token j occurs in the request's output so far, as OpenAI documents the two
penalties, and rep = the multiplicative penalty of CTRL (Keskar et al. 2019, arXiv 1909.05858) on every
token seen in the prompt or the output so far: a positive logit is divided by it, a negative one
multiplied, as vLLM and transformers apply it (vLLM too adds the bias first and the additive penalties
after it; llama.cpp's `repeat_penalty` is the same rule over a window of recent tokens). For a diffusion
model "so far" means the output tokens committed before this step (in any earlier block or step), so
tokens committed together in one step do not penalise each other; where a step revises committed tokens
(docs/decoding.md, "Editing committed tokens"), the counts follow the text: a token an edit replaced or a
remask took back no longer counts. Tensors only: a sequence owns one `Adjuster`, calls `adjust` on each
step's logits before the policy sees them, `commit` with the tokens it committed and `withdraw` with those
it took out of the text.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

BIAS_LIMIT = 100.0      # OpenAI: values from -100 to 100
PENALTY_LIMIT = 2.0     # OpenAI: -2.0 to 2.0
REPETITION_LIMIT = 10.0  # vLLM and transformers only ask for > 0; beyond ~2 every seen token is all but banned


@dataclass(frozen=True)
class LogitAdjust:
    bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0   # 1 = off

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or self.repeats

    @property
    def repeats(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def active(self) -> bool:
        return bool(self.bias) or self.penalised


def validate(bias: dict[int, float] | None, presence: float, frequency: float,
             repetition: float = 1.0) -> str | None:
    """Why these settings are out of range (param: message), or None."""
    for name, v in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not -PENALTY_LIMIT <= v <= PENALTY_LIMIT:
            return f"{name} must be in [-2, 2], got {v}"
    if not 0 < repetition <= REPETITION_LIMIT:
        return f"repetition_penalty must be in (0, {REPETITION_LIMIT:g}] (1 = off), got {repetition}"
    for tok, v in (bias or {}).items():
        if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
            return f"logit_bias keys must be token ids (non-negative integers), got {tok!r}"
        if not -BIAS_LIMIT <= v <= BIAS_LIMIT:
            return f"logit_bias values must be in [-100, 100], got {v} for token {tok}"
    return None


class Adjuster:
    """One request's adjustment state: the bias as tensors, the counts of committed output tokens, and
    (repetition_penalty) the prompt tokens, which count as seen from the first step."""

    def __init__(self, spec: LogitAdjust, prompt_ids: list[int] | None = None):
        self.spec = spec
        self.prompt_ids = torch.tensor(sorted(set(prompt_ids or ())) if spec.repeats else [], dtype=torch.long)
        self._prompt_placed = False
        self.bias_ids = torch.tensor([t for t, _ in spec.bias], dtype=torch.long)
        self.bias_values = torch.tensor([v for _, v in spec.bias], dtype=torch.float32)
        self.counts: Tensor | None = None   # [V], allocated at the first step (the logits give V)
        self._pending: list[tuple[Tensor, float]] = []  # (tokens, +1 committed / -1 withdrawn) before that

    def adjust(self, logits: Tensor) -> Tensor:
        """In place on [M, V] logits (every row is a position of this request); returns them."""
        return self.adjust_causal(logits, None)

    def adjust_causal(self, logits: Tensor, earlier: Tensor | None) -> Tensor:
        """`adjust` for rows that are consecutive positions: row i also counts `earlier[:i]` as output (a
        speculative step's verifier rows, each of which follows the drafts before it), so row i is adjusted
        exactly as one-token-per-forward decoding would adjust it once those drafts were committed."""
        if self.bias_ids.numel():
            if self.bias_ids.device != logits.device:
                self.bias_ids, self.bias_values = self.bias_ids.to(logits.device), self.bias_values.to(logits.device)
            logits[:, self.bias_ids] += self.bias_values.to(logits.dtype)
        if self.spec.penalised:
            if self.counts is None or self.counts.device != logits.device:
                self.counts = (torch.zeros(logits.shape[-1], dtype=torch.float32, device=logits.device)
                               if self.counts is None else self.counts.to(logits.device))
                for t, weight in self._pending:
                    self._count(t, weight)
                self._pending = []
            counts = self.counts
            if earlier is not None and earlier.numel():  # [M, V]: row i's counts take earlier[:i] in
                n = min(int(earlier.numel()), logits.shape[0] - 1)
                one_hot = torch.zeros(logits.shape[0], counts.shape[0], device=counts.device)
                one_hot[torch.arange(1, n + 1, device=counts.device), earlier[:n].to(counts.device)] = 1.0
                counts = counts + one_hot.cumsum(0)   # row i: + earlier[:i] (rows past n: all of them)
            s = self.spec
            if s.repeats:
                self._repetition(logits, counts)
            if s.presence_penalty or s.frequency_penalty:
                penalty = s.frequency_penalty * counts + s.presence_penalty * (counts > 0).float()
                logits -= penalty.to(logits.dtype)
        return logits

    def _repetition(self, logits: Tensor, counts: Tensor) -> None:
        if not self._prompt_placed:  # once: ids outside the vocabulary dropped, the rest moved to the device
            self.prompt_ids = self.prompt_ids[self.prompt_ids < logits.shape[-1]].to(logits.device)
            self._prompt_placed = True
        r = self.spec.repetition_penalty
        seen = counts > 0                 # [V], or [M, V] with adjust_causal's per-row counts
        seen[..., self.prompt_ids] = True
        logits.copy_(torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits))

    def commit(self, tokens: Tensor) -> None:
        """Count newly committed output tokens."""
        self._count(tokens, 1.0)

    def withdraw(self, tokens: Tensor) -> None:
        """Uncount output tokens taken out of the text (an edit replaced them, a remask put their position back to
        mask): the penalties count the tokens the output holds, not every token ever written."""
        self._count(tokens, -1.0)

    def _count(self, tokens: Tensor, weight: float) -> None:
        if not self.spec.penalised or not tokens.numel():
            return
        if self.counts is None:
            self._pending.append((tokens.reshape(-1).cpu(), weight))
            return
        t = tokens.reshape(-1).to(self.counts.device)
        self.counts.index_add_(0, t, torch.full((t.numel(),), weight, dtype=self.counts.dtype, device=t.device))


def ban_early_stops(logits: Tensor, output_index: Tensor, min_tokens: int, stops: set[int]) -> None:
    """`min_tokens` as vLLM means it: no stop token among the first `min_tokens` outputs. Sets the stop
    tokens' logits to -inf, in place, on the rows of [N, V] `logits` whose output index (0 = the first
    generated token) is below `min_tokens`."""
    if not min_tokens or not stops:
        return
    early = (output_index < min_tokens).to(logits.device)
    if not bool(early.any()):
        return
    banned = torch.tensor(sorted(t for t in stops if t < logits.shape[1]), device=logits.device)
    logits[early.nonzero()[:, 0][:, None], banned[None, :]] = float("-inf")
