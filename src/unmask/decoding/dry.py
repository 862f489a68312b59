"""DRY ("Don't Repeat Yourself"), the loop penalty of llama.cpp's server and text-generation-webui
(p-e-w, text-generation-webui PR 5677; llama.cpp PR 9702). Where the text so far ends with a sequence
that occurred before, the token that followed it then is penalised, exponentially in the match length:

    penalty(token) = multiplier * base ** (n - allowed_length)   for the longest such match n >= allowed_length

Unlike the frequency and repetition penalties it leaves single tokens alone (`self`, `(`, indentation
recur in any code) and only stops a verbatim repeat of a run of tokens from growing. Sequence breakers
(tokens whose text holds one of the breaker strings: newline, `:`, quote, `*` by default, as llama.cpp)
end a match, so repeats across lines and sentences stay allowed.

For a diffusion model the penalty applies to the first not-yet-committed position, whose left context is
all committed; positions behind a hole have no fixed left context. Pure functions, no model.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

DEFAULT_BREAKERS = ("\n", ":", "\"", "*")   # llama.cpp's default dry_sequence_breakers
MAX_BREAKERS = 64


@dataclass(frozen=True)
class DryParams:
    multiplier: float = 0.0          # 0 = off (llama.cpp's default)
    base: float = 1.75
    allowed_length: int = 2
    last_n: int = -1                 # how many tokens of context to search; -1 = all, 0 = off
    breakers: tuple[str, ...] = DEFAULT_BREAKERS

    @property
    def active(self) -> bool:
        return self.multiplier > 0 and self.last_n != 0

    @property
    def max_match(self) -> int:
        """Longer matches than this change nothing: the penalty is already past any logit (1e4)."""
        if self.base <= 1:
            return self.allowed_length
        grow = 0
        while self.multiplier * self.base ** grow < 1e4 and grow < 256:
            grow += 1
        return self.allowed_length + grow


def validate(p: DryParams) -> str | None:
    """Why these settings are out of range (param: message), or None."""
    if not 0 <= p.multiplier <= 10:
        return f"dry_multiplier must be in [0, 10] (0 = off), got {p.multiplier}"
    if not 1 <= p.base <= 10:
        return f"dry_base must be in [1, 10], got {p.base}"
    if not isinstance(p.allowed_length, int) or isinstance(p.allowed_length, bool) or not 1 <= p.allowed_length <= 64:
        return f"dry_allowed_length must be an integer in [1, 64], got {p.allowed_length!r}"
    if not isinstance(p.last_n, int) or isinstance(p.last_n, bool) or p.last_n < -1:
        return f"dry_penalty_last_n must be an integer >= -1 (-1 = the whole context), got {p.last_n!r}"
    if len(p.breakers) > MAX_BREAKERS or any(not isinstance(b, str) or not b for b in p.breakers):
        return f"dry_sequence_breakers must be at most {MAX_BREAKERS} non-empty strings"
    return None


def breaker_mask(token_texts: list[str], breakers: tuple[str, ...]) -> Tensor:
    """[V] bool: the tokens whose text contains a breaker string."""
    return torch.tensor([any(b in t for b in breakers) for t in token_texts], dtype=torch.bool)


def dry_penalty(context: Tensor, params: DryParams, breakers: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The DRY penalty for the token after `context` ([L] token ids): (token ids [K], penalties [K]).

    Match lengths are counted back from the end of the context: position j matches with length n when
    context[j-n+1 .. j] equals the context's last n tokens, none of them a breaker; the token context[j+1]
    then gets multiplier * base ** (n - allowed_length) if n >= allowed_length (the largest over j).
    NumPy inside: a step's context is short and on the CPU, where torch's per-op cost would dominate."""
    ctx = context.cpu().numpy()
    if params.last_n > 0:
        ctx = ctx[-params.last_n:]
    L = ctx.size
    empty = (torch.empty(0, dtype=torch.long), torch.empty(0))
    if L < params.allowed_length + 1:
        return empty
    if breakers is not None:
        table = breakers.cpu().numpy()
        brk = table[np.minimum(ctx, table.size - 1)]
    else:
        brk = np.zeros(L, dtype=bool)
    if brk[-1]:
        return empty
    hits = np.flatnonzero(brk)
    tail = L - 1 - int(hits[-1]) if hits.size else L       # the tail without breakers bounds every match
    limit = min(tail, params.max_match, L - 1)
    ends = np.flatnonzero(ctx[:-1] == ctx[-1])              # match ends j (context[j+1] exists)
    lengths = np.ones(ends.size, dtype=np.int64)
    alive = np.arange(ends.size)                            # indices into ends still matching
    length = 1
    while alive.size and length < limit:
        back = ends[alive] - length
        ok = back >= 0
        alive, back = alive[ok], back[ok]
        ok = (ctx[back] == ctx[L - 1 - length]) & ~brk[back]
        alive = alive[ok]
        length += 1
        lengths[alive] = length
    keep = lengths >= params.allowed_length
    if not keep.any():
        return empty
    tokens = ctx[ends[keep] + 1]
    n = lengths[keep]
    order = np.lexsort((n, tokens))                          # per token, its longest match last
    last = np.r_[tokens[order][1:] != tokens[order][:-1], True]
    ids, best = tokens[order][last], n[order][last]
    penalty = params.multiplier * params.base ** (best - params.allowed_length).astype(np.float64)
    return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(penalty.astype(np.float32))
