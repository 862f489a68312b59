"""Grammar enforcement inside the denoising loop.

A grammar matcher reads left to right; a diffusion model proposes every masked position of its
block at once and commits them in any order. The two are reconciled by treating the model's
parallel proposals as drafts, verified left to right like speculative decoding drafts:

  1. The leftmost uncommitted position is proposed under the grammar's token mask (its logits
     outside the mask are -inf), so it is always valid.
  2. The policy (threshold, entropy bound, ...) runs unchanged on all rows and marks the drafts
     it is confident in. The run of marked drafts that starts at the leftmost position is checked
     by the matcher; its longest accepted prefix is committed at once.
  3. If the matcher refuses a draft the policy wanted, that position is resampled under the mask
     (as in step 1) and committed too; everything right of it stays masked for the next forward,
     which then sees the corrected prefix.
  4. Bytes the grammar forces (`{"name": "` of a schema, `</tool_call>`, the rest of an enum value)
     are committed as tokens without asking the model (jump-forward decoding, as in SGLang).
  5. Budget: within the last CLOSE_WINDOW positions of the canvas (more for grammars whose shortest
     output is long), a commit is kept only if the grammar can still be completed in the room left
     (checked by a short greedy completion); otherwise it is rolled back and the completion itself
     is committed. So a weak model cannot run JSON past max_tokens: the output closes in time.

Commits therefore always extend the committed prefix without holes, every committed token has
been consumed by the matcher (the output is a prefix of the language, and complete when the
grammar's end-of-sequence is committed), and a step commits as many tokens as the policy's
confident prefix plus forced bytes. Out-of-order confident tokens right of a non-confident one are
not kept; they are usually proposed again with more context on the next forward.

Related designs: DINGO (arXiv 2505.23061) runs a DP over the whole block for regular constraints;
Mündler et al. (arXiv 2508.10111) keep out-of-order commits and decide CFG∩regular emptiness.
Both are heavier per step; this one costs one mask per step plus cheap token validations.
"""
from __future__ import annotations

import torch
from torch import Tensor

from unmask.decoding import BlockState, PolicyConfig, SamplingParams, decide, propose
from unmask.structured.guard import JsonGuard

ATTEMPTS = 4        # whole answers a schema with an after-draft check may take (schema.py)
RETRY_TEMPERATURE = 0.8   # at least this on attempts after the first: a greedy answer would only repeat itself
CLOSE_WINDOW = 96   # canvas positions from the end within which commits are budget-checked
LOOKAHEAD = 16      # allowed tokens tried when the budget closer has to choose one
CLOSE_FUEL = 64     # token masks one closing search may compute
_PROBE = "a"        # a token valid here but never outside a JSON string: we are inside a string


class Constraint:
    """One request's grammar state. The matcher has consumed exactly the committed output prefix."""

    def __init__(self, matcher, backend, json: bool = False, check=None, relaxed: tuple[str, ...] = (),
                 unique: dict | None = None):
        self.m = matcher
        self._start = matcher.deep_copy()   # for another attempt (`reset`)
        self.json = json
        self.facts = backend.token_facts() if json else None
        self.unique = unique or {}    # uniqueItems arrays of scalars the guard keeps distinct (path -> item set)
        self.guard = JsonGuard(unique) if json else None   # duplicate keys and items, runaway numbers (guard.py)
        self.check = check            # JSON Schema validated after the draft (schema.py), or None
        self.relaxed = relaxed
        self.attempts = 1
        self.retry_temperature = RETRY_TEMPERATURE
        self.budget_cut = False       # the budget closer cut or replaced what the model proposed
        self.backend = backend
        self.vocab = backend.vocab_size
        self.stops = set(backend.stop_ids)
        self.eos = backend.stop_ids[0]
        self._bits = torch.zeros((backend.lltok.vocab_size + 31) // 32, dtype=torch.int32)
        self._shifts = torch.arange(32, dtype=torch.int32)
        probe = backend.tok.encode(_PROBE)
        self._probe = probe[0] if len(probe) == 1 else None
        self.window: int | None = None  # budget-checked tail of the canvas; set on the first step
        self._fuel = CLOSE_FUEL
        self.forced = 0      # tokens committed from forced bytes (stats)
        self.resampled = 0   # drafts the grammar refused and that were resampled under the mask

    # ------------------------------------------------------------------ masks
    def allowed(self, matcher=None) -> Tensor:
        """bool [V]: tokens the grammar accepts next. A plain torch unpack of llguidance's bitmask."""
        m = matcher or self.m
        m.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        if m.is_error():
            raise RuntimeError(f"grammar matcher failed: {m.get_error()}")
        bits = (self._bits.unsqueeze(1) >> self._shifts) & 1   # [words, 32], bit j of word w = token 32w + j
        return bits.view(-1)[: self.vocab].bool()

    def mask_row(self, row: Tensor, guard: JsonGuard | None = None) -> None:
        """Logits outside the grammar's next-token mask (less what `guard` bans) -> -inf, in place."""
        allowed = self.allowed()
        guard = guard or self.guard
        if guard is not None:
            allowed = guard.restrict(allowed, self.facts)
        row.masked_fill_(~allowed.to(row.device), float("-inf"))

    # ------------------------------------------------------------------ one step
    def step(self, logits: Tensor, offsets: Tensor, cfg: PolicyConfig, block: BlockState,
             sampling: SamplingParams, generator: torch.Generator | None, room: int) -> tuple[list[int], list[float]]:
        """Tokens (and their probabilities) for the leftmost masked positions of the block, in order.

        logits [M, V]: rows of the still-masked positions, the first being the position right after
        the committed prefix; room: canvas positions left from there. Returns 1..M tokens.
        """
        self.mask_row(logits[0])
        d = decide(cfg, logits, offsets, block, sampling, generator)
        return self.verify(logits, d.tokens.tolist(), d.commit.tolist(), d.probs.tolist(), sampling, generator,
                           room)

    def verify(self, logits: Tensor, tokens: list[int], commit: list[bool], probs: list[float],
               sampling: SamplingParams, generator: torch.Generator | None,
               room: int) -> tuple[list[int], list[float]]:
        """Steps 2-5 for drafts already chosen: `tokens[i]` proposed for row i of `logits` [M, V] (row 0 is the
        position right after the committed prefix), `commit[i]` whether the policy is confident in it.
        Token 0 is always taken (checked, and resampled under the mask if refused). Returns 1..M tokens,
        consumed by the matcher. Decoders with their own acceptance rule (uniform noise) call this directly."""
        m, rows = self.m, logits.shape[0]
        self._ensure_window(room)
        run = [tokens[0]]
        for i in range(1, rows):
            if not commit[i] or run[-1] in self.stops:
                break
            run.append(tokens[i])
        base, guard_cut = self.guard, False
        if base is not None:  # a draft the guard refuses is cut like one the grammar refuses
            g = base.copy()
            for i, t in enumerate(run):
                if t not in self.stops and not g.feed(self.facts.bytes[t]) and i:  # token 0 is taken (step 1)
                    run, guard_cut = run[:i], True
                    break
        n = m.validate_tokens(run)
        out, p = run[:n], probs[:n]
        m.consume_tokens(out)
        if n < len(run) or guard_cut:
            # a draft the policy was sure of and the grammar (or the guard) refuses: resample it under the mask
            row = logits[n:n + 1].clone()
            self.mask_row(row[0], self._guard_after(base, out) if base is not None else None)
            prop = propose(row, sampling, generator, need_entropy=False)
            out.append(int(prop.tokens[0]))
            p.append(float(prop.probs[0]))
            m.consume_token(out[-1])
            self.resampled += 1
        return self._extend(out, p, base, room, rows)

    def _ensure_window(self, room: int) -> None:
        if self.window is None:  # a grammar whose shortest output is long needs its budget checks earlier
            shortest = self.closing_path(room)
            self.window = max(CLOSE_WINDOW, 2 * len(shortest) + 8) if shortest is not None else CLOSE_WINDOW

    def _extend(self, out: list[int], p: list[float], base: JsonGuard | None, room: int,
                rows: int) -> tuple[list[int], list[float]]:
        """After `out` was consumed: the bytes the grammar forces (up to `rows` tokens in all), the end where
        nothing may follow, the budget (steps 4-5); the guard brought level with what stays."""
        m = self.m
        if not self._ended(out) and len(out) < rows:
            forced = m.compute_ff_tokens()[: rows - len(out)]
            if forced:
                m.consume_tokens(forced)
                out += forced
                p += [1.0] * len(forced)
                self.forced += len(forced)
        if not self._ended(out) and len(out) < rows and m.is_stopped():
            m.consume_token(self.eos)  # complete and nothing may follow: end now, not one forward later
            out.append(self.eos)
            p.append(1.0)
        if room - len(out) < self.window and not self._ended(out):
            out, p = self._fit(out, p, room, rows)
        if base is not None:
            self.guard = self._guard_after(base, out)
        return out, p

    # ------------------------------------------------------------------ a chain of drafts (policy speculative)
    def chain_masks(self, drafts: list[int]) -> list[Tensor]:
        """bool [V] masks of a draft chain's verifier rows: row i's is what the grammar (less what the guard bans)
        allows after the committed text and drafts[:i]. One row per draft the grammar accepts in order, plus the
        row after them: so len - 1 drafts can be kept (the chain ends before a stop token). The matcher and the
        guard are left as they were. This is how `speculative` keeps its output the constrained next-token
        decoding: each kept draft and the verifier's own token are the argmax (or a draw) of a row masked as that
        decoding would have masked it."""
        masks, guard, fed = [], self.guard.copy() if self.guard is not None else None, 0
        try:
            for t in drafts + [None]:
                allowed = self.allowed()
                if guard is not None:
                    allowed = guard.restrict(allowed, self.facts)
                masks.append(allowed)
                if t is None or not bool(allowed[t]) or t in self.stops:
                    break  # a refused draft cannot be kept; a stop draft needs no row after it: the row that
                    # would keep it chooses its own token from the same masked row, the stop where it agrees
                self.m.consume_token(t)
                fed += 1
                if guard is not None:
                    guard.feed(self.facts.bytes[t])
        finally:
            if fed:
                self.m.rollback(fed)
        return masks

    def commit_chain(self, tokens: list[int], room: int) -> list[int]:
        """Commit the tokens a verifier chose from `chain_masks` rows (each allowed where it stands), then what
        the grammar forces after them and the budget rule (steps 4-5), within `room` positions. Returns the
        committed tokens: `tokens`, then forced ones, or a shorter prefix and a closing text where the budget
        cut them."""
        self._ensure_window(room)
        base = self.guard
        self.m.consume_tokens(tokens)
        out, _ = self._extend(list(tokens), [1.0] * len(tokens), base, room, room)
        return out

    def _guard_after(self, base: JsonGuard, tokens: list[int]) -> JsonGuard:
        g = base.copy()
        for t in tokens:
            if t not in self.stops:
                g.feed(self.facts.bytes[t])
        g.violation = None
        return g

    def complete(self) -> bool:
        """The output read so far is a complete member of the grammar's language."""
        return self.m.is_accepting()

    def finish_reason(self, reason: str) -> str:
        """The finish reason of an output that ended with `reason` ("stop": a stop token; "length": the canvas
        is full). "length" whenever the budget ended it: the closer cut the model's tokens or wrote the end
        itself, or the canvas filled while the grammar could still go on; "stop" for a complete output that
        ended by itself (a stop token, or a grammar after which nothing may follow)."""
        if self.budget_cut:
            return "length"
        if reason == "length" and self.m.is_accepting() and self.m.is_stopped():
            return "stop"
        return reason

    # ------------------------------------------------------------------ after the draft
    @property
    def holds_back(self) -> bool:
        """Whether the answer is released only once it passed `final_error` (schema.py's after-draft check)."""
        return self.check is not None

    def final_error(self, text: str) -> str | None:
        """Why a complete JSON answer is not acceptable (a repeated key, the after-draft check), or None."""
        from unmask.structured.schema import check_error, parse_json

        value, err = parse_json(text)
        if err is None and self.check is not None:
            err = check_error(self.check, value)
        return err

    def retry(self) -> bool:
        """Start another attempt (fresh grammar and guard state) if the budget allows; False if spent."""
        if self.attempts >= ATTEMPTS:
            return False
        self.attempts += 1
        self.m = self._start.deep_copy()
        self.guard = JsonGuard(self.unique) if self.json else None
        self.window, self._fuel, self.budget_cut = None, CLOSE_FUEL, False
        return True

    def _ended(self, out: list[int]) -> bool:
        return bool(out) and out[-1] in self.stops

    # ------------------------------------------------------------------ budget
    def _fit(self, out: list[int], p: list[float], room: int, rows: int) -> tuple[list[int], list[float]]:
        """Keep the longest prefix of `out` after which the grammar can still be completed within `room`."""
        if self.closing_path(room - len(out), out) is not None:
            return out, p
        self.budget_cut = True
        self.m.rollback(len(out))
        path = self.closing_path(room)
        if path is None:  # cannot be closed in time whatever we do: keep the model's tokens
            self.m.consume_tokens(out)
            return out, p
        kept = 0
        while kept < len(out) - 1:  # the full run does not fit; find the longest prefix that does
            self.m.consume_token(out[kept])
            if self.closing_path(room - kept - 1, out[:kept + 1]) is None:
                self.m.rollback(1)
                break
            kept += 1
        if kept:
            return out[:kept], p[:kept]
        path = (path + [self.eos])[:rows]  # nothing of the model's fits: commit the completion itself
        self.m.consume_tokens(path)
        return path, [1.0] * len(path)

    def closing_path(self, limit: int, fed: list[int] = ()) -> list[int] | None:
        """A short token sequence that completes the grammar from here (at most `limit` tokens), or None. `fed`:
        tokens the matcher consumed after the guard's state (so the guard is brought level with it). With a
        JSON guard the path obeys it too: a completion must not close a key that the object already has."""
        self._fuel = CLOSE_FUEL
        guard = self._guard_after(self.guard, list(fed)) if self.guard is not None else None
        return self._greedy(self.m.deep_copy(), limit, lookahead=True, guard=guard)

    def _greedy(self, c, limit: int, lookahead: bool, guard: JsonGuard | None = None) -> list[int] | None:
        """Greedy completion of matcher `c` (consumed as it goes, as is `guard`): forced bytes; else a closing text
        (backend.CLOSERS: a string's quote first inside a string, else `}` `]` `"` `0`) the guard allows; else one
        of the allowed tokens, chosen with `lookahead` as the one whose own greedy completion is shortest (among the
        LOOKAHEAD lowest ids). Exact where nothing is left to choose, short and terminating for JSON."""
        path: list[int] = []
        closers = self.backend.closers

        def take(ids: list[int]) -> None:
            c.consume_tokens(ids)
            path.extend(ids)
            if guard is not None:
                self._feed(guard, ids)

        while not c.is_accepting():
            if len(path) >= limit:
                return None
            forced = c.compute_ff_tokens()
            if forced:
                take(forced)
                continue
            in_string = self._probe is not None and c.validate_tokens([self._probe]) == 1
            for ids in closers["string" if in_string else "value"]:
                if c.validate_tokens(ids) == len(ids) and (guard is None or self._feed(guard.copy(), ids)):
                    take(ids)
                    break
            else:
                self._fuel -= 1
                if self._fuel < 0:  # a grammar the greedy closer cannot finish: give up, cheaply
                    return None
                allowed = self.allowed(c)
                if guard is not None:
                    allowed = guard.restrict(allowed, self.facts)
                ok = [t for t in allowed.nonzero().flatten().tolist() if t not in self.stops][:LOOKAHEAD]
                if not ok:
                    return None
                if not lookahead or len(ok) == 1:
                    take(ok[:1])
                    continue
                best: list[int] | None = None
                for t in ok:
                    branch, fork = c.deep_copy(), guard.copy() if guard is not None else None
                    branch.consume_token(t)
                    if fork is not None:
                        self._feed(fork, [t])
                    rest = self._greedy(branch, limit - len(path) - 1 if best is None else len(best) - 1, False,
                                        fork)
                    if rest is not None and (best is None or 1 + len(rest) < len(best)):
                        best = [t] + rest
                return None if best is None else path + best
        return path if len(path) <= limit else None

    def _feed(self, guard: JsonGuard, ids: list[int]) -> bool:
        """Feed `ids`' bytes (stop tokens carry none) to `guard`; False if it refuses one."""
        return all(guard.feed(self.facts.bytes[t]) for t in ids if t not in self.stops)
