"""Unmasking policies: which of the proposed tokens a denoising step commits.

The engine calls `decide` once per step for each request with the logits of the still-masked rows of its
active block (rows in position order). Every policy is a small function of confidences or counts, registered
in `POLICIES`. Guarantees for all policies: M == 0 -> empty decision; M > 0 -> at least one commit (except
Dream's schedules with `empty_steps`, whose count may be 0 before the last step); the same generator seed gives
the same decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from .commit_filter import CommitFilter, commit_rows, features
from .sampling import Proposal, SamplingParams, propose
from .schedules import dream_count, dream_reveal_prob, even_split_at


@dataclass(frozen=True)
class PolicyConfig:
    """How a request unmasks its block. Validated on construction."""

    name: str = "threshold"  # a key of POLICIES
    threshold: float = 0.9  # confidence threshold for "threshold" and "credit", in (0, 1]
    factor: float = 1.0  # f of the Fast-dLLM factor rule, > 0
    steps: int | None = None  # denoising steps per block for schedule policies; None = one step per masked token
    entropy_bound: float = 0.35  # gamma of "entropy_bounded", in nats, >= 0
    alg_temp: float = 0.0  # Dream alg_temp: > 0 samples positions from softmax(conf / alg_temp)
    credit_decay: float = 0.8  # dInfer credit EMA decay (beta), in [0, 1]
    credit_gamma: float = 0.2  # exponent on the top-1 probability added to the credit, > 0
    credit_weight: float = 0.7  # alpha in fused = logits + alpha * log(1 + C), >= 0
    tokens_per_step: int | None = None  # k of "topk"; None = 1 (one token per forward, the AR-equivalent baseline)
    # Dream's schedules (maskgit_plus, topk_margin, entropy, origin): True follows the reference's count even when
    # it is 0 (the step commits nothing); False commits at least one row every step
    empty_steps: bool = False
    # "learned": the model's fitted filter (generation_config.json, set by the engine); `threshold` is then the
    # predicted probability that a proposal is final
    commit_filter: CommitFilter | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.name not in POLICIES and self.name not in (LEARNED, SPECULATIVE):
            raise ValueError(f"name: unknown decoding policy {self.name!r}; valid: "
                             f"{', '.join(sorted([*POLICIES, LEARNED, SPECULATIVE]))}")
        _check(0 < self.threshold <= 1, "threshold", "in (0, 1]", self.threshold)
        _check(self.factor > 0, "factor", "> 0", self.factor)
        _check(self.steps is None or self.steps >= 1, "steps", ">= 1 or None", self.steps)
        _check(self.entropy_bound >= 0, "entropy_bound", ">= 0", self.entropy_bound)
        _check(self.alg_temp >= 0, "alg_temp", ">= 0", self.alg_temp)
        _check(0 <= self.credit_decay <= 1, "credit_decay", "in [0, 1]", self.credit_decay)
        _check(self.credit_gamma > 0, "credit_gamma", "> 0", self.credit_gamma)
        _check(self.credit_weight >= 0, "credit_weight", ">= 0", self.credit_weight)
        _check(self.tokens_per_step is None or self.tokens_per_step >= 1, "tokens_per_step", ">= 1 or None",
               self.tokens_per_step)


def _check(ok: bool, field: str, rule: str, value: object) -> None:
    if not ok:  # written so that NaN fails too
        raise ValueError(f"{field} must be {rule}, got {value!r}")


@dataclass
class CreditState:
    """Sparse dInfer credit matrix C[position-in-block, token] as coalesced COO entries (all [K]).

    Only positions still masked are kept, so K <= (masked rows) x (steps taken). A dense [block, V] matrix
    would cost block * V floats per request for a handful of non-zeros.
    """

    pos: Tensor  # long: offset of the position within the block
    tok: Tensor  # long: vocabulary id
    val: Tensor  # float32: accumulated credit


@dataclass
class BlockState:
    """Per-request decoding state of the active block; the engine makes a fresh one at each block start."""

    initial_masked: int  # masked positions when the block started
    step: int = 0  # steps already taken in this block (decide() increments it)
    credit: CreditState | None = None  # "credit" policy only


@dataclass
class Decision:
    """What one step commits (all [M], rows as in the logits)."""

    commit: Tensor  # bool; at least one True when M > 0 (unless cfg.empty_steps)
    tokens: Tensor  # long: proposed tokens; the engine writes tokens[commit]
    probs: Tensor  # float32: p(token) under the distribution the policy judged (for logprobs)


LEARNED = "learned"  # the commit filter's rule: it reads the rows' positions, which the other rules do not
# drafts verified by the next-token rows of the same forward (decoding/speculative.py, engine/speculative.py): not a
# rule over masked rows, so `decide` never sees it
SPECULATIVE = "speculative"
NEEDS_ENTROPY = frozenset({"entropy", "entropy_bounded", LEARNED})
Rule = Callable[[PolicyConfig, Proposal, BlockState, torch.Generator | None], Tensor]


def decide(cfg: PolicyConfig, logits: Tensor, positions: Tensor, state: BlockState, sampling: SamplingParams,
           generator: torch.Generator | None = None) -> Decision:
    """One denoising step's decision for one request.

    Args: logits [M, V] of the still-masked rows of the active block in position order (or their greedy
    `Proposal`, made where the logits are, for rules that need no entropy: steps 1-2 are then done); positions [M] long,
    their offsets within the block (keys of the credit state).

    Steps:
      1. "credit" only: update the block's credit with this step's top-1 tokens and fuse it into the logits.
      2. Propose one token per row (`propose`: temperature, top-k, top-p, sampling).
      3. Apply the named rule to the proposal's confidences -> commit mask.
      4. state.step += 1 (also for M == 0, so every call counts as a step).
    """
    if isinstance(logits, Proposal):  # proposed already (greedy, on the device: unmask.engine.static_step)
        if cfg.name == "credit" or cfg.name in NEEDS_ENTROPY:
            raise ValueError(f"policy {cfg.name!r} needs the logits, not a greedy proposal")
        commit = getattr(logits, "commit", None)  # decided there too (decoding/device_select.py): the same rule
        if commit is None:
            commit = POLICIES[cfg.name](cfg, logits, state, generator)
        state.step += 1
        return Decision(commit=commit, tokens=logits.tokens, probs=logits.probs)
    m = logits.shape[0]
    if positions.shape != (m,):
        raise ValueError(f"positions must be [M] = [{m}], got shape {tuple(positions.shape)}")
    if m == 0:
        state.step += 1
        empty = logits.new_empty(0, dtype=torch.float32)
        return Decision(commit=torch.zeros(0, dtype=torch.bool, device=logits.device),
                        tokens=torch.zeros(0, dtype=torch.long, device=logits.device), probs=empty)
    logits = logits.float()
    if cfg.name == "credit":
        state.credit = update_credit(state.credit, logits, positions, cfg.credit_decay, cfg.credit_gamma)
        logits = fuse_credit(logits, positions, state.credit, cfg.credit_weight)
    proposal = propose(logits, sampling, generator, need_entropy=cfg.name in NEEDS_ENTROPY)
    if cfg.name == LEARNED:
        commit = learned(cfg, proposal, positions, state)
    else:
        commit = POLICIES[cfg.name](cfg, proposal, state, generator)
    state.step += 1
    return Decision(commit=commit, tokens=proposal.tokens, probs=proposal.probs)


# ----------------------------------------------------------------------------------------------------------------
# Selection primitives: pure functions of confidences and counts.


def top_rows(conf: Tensor, n: int) -> Tensor:
    """Bool [M] marking the n highest `conf`; ties go to the lower row (stable sort), identical on CPU and GPU."""
    order = torch.sort(conf, descending=True, stable=True).indices
    commit = torch.zeros_like(conf, dtype=torch.bool)
    commit[order[:n]] = True
    return commit


def sample_rows(conf: Tensor, n: int, temp: float, generator: torch.Generator | None) -> Tensor:
    """Bool [M]: n rows drawn without replacement from softmax(conf / temp) (Dream alg_temp)."""
    weights = torch.softmax(conf.float() / temp, dim=0).clamp_min(1e-30)  # all > 0 so n <= M draws always succeed
    if generator is not None and generator.device != weights.device:
        weights = weights.to(generator.device)
    picked = torch.multinomial(weights, n, replacement=False, generator=generator).to(conf.device)
    commit = torch.zeros(conf.shape[0], dtype=torch.bool, device=conf.device)
    commit[picked] = True
    return commit


def uniform(n: int, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """n U[0, 1) draws from `generator`, returned on `device`."""
    src = generator.device if generator is not None else device
    return torch.rand(n, generator=generator, device=src).to(device)


def threshold_mask(conf: Tensor, tau: float) -> Tensor:
    """Bool [M]: conf >= tau, plus the single most confident row so the step always progresses.

    Source: NVlabs/Fast-dLLM llada/generate.py `get_transfer_index` (threshold); dInfer uses min(tau, max - 1e-5).
    """
    commit = conf >= tau
    commit[conf.argmax()] = True
    return commit


def factor_count(conf: Tensor, factor: float) -> int:
    """Largest n with c_i >= 1 - factor / (i + 1) for all 1-based i <= n, c sorted descending; at least 1.

    Source: NVlabs/Fast-dLLM llada/generate.py `get_transfer_index_dynamic`, whose loop also forces i = 1.
    Their loop adds one more token when the *last* candidate fails; we implement the rule as stated instead.
    """
    c = torch.sort(conf.float(), descending=True).values
    i = torch.arange(1, c.shape[0] + 1, device=c.device, dtype=torch.float32)
    ok = c >= 1 - factor / (i + 1)
    ok[0] = True
    return int(ok.int().cumprod(dim=0).sum())


def entropy_bound_count(entropy: Tensor, bound: float) -> int:
    """Largest k with sum(H_1..H_k) - max(H_1..H_k) <= bound over entropies sorted ascending; at least 1.

    Sorted ascending, the max is H_k, so the test is on the sum of the first k - 1 entropies (monotone in k).
    Source: arXiv 2505.24857 (entropy-bounded unmasking), as used by SDAR and DiffusionGemma.
    """
    h = torch.sort(entropy.float()).values
    before = h.cumsum(dim=0) - h
    return max(1, int((before <= bound).sum()))


def clamp_count(n: int, m: int) -> int:
    """Quotas are clamped to [1, M]: never stall, never exceed what is masked."""
    return max(1, min(n, m))


def block_steps(cfg: PolicyConfig, state: BlockState) -> int:
    """Scheduled steps for this block: cfg.steps, or one per initially masked token."""
    return cfg.steps if cfg.steps is not None else max(1, state.initial_masked)


# ----------------------------------------------------------------------------------------------------------------
# dInfer credit decoding (arXiv 2510.06133; inclusionAI/dInfer CreditThresholdParallelDecoder).


def update_credit(credit: CreditState | None, logits: Tensor, positions: Tensor, decay: float,
                  gamma: float) -> CreditState:
    """C <- decay * C, then C[pos, top1(pos)] += p_top1(pos) ** gamma for every masked row; raw-logit softmax.

    Entries of positions no longer masked are dropped (they are never read again).
    """
    vocab = logits.shape[1]
    top1 = logits.argmax(dim=-1)
    p1 = (logits.gather(1, top1.unsqueeze(1)).squeeze(1) - torch.logsumexp(logits, dim=-1)).exp()
    gain = p1.pow(gamma)
    if credit is None or credit.pos.numel() == 0:
        return CreditState(pos=positions.clone(), tok=top1, val=gain)
    keep = torch.isin(credit.pos, positions)
    pos = torch.cat([credit.pos[keep], positions])
    tok = torch.cat([credit.tok[keep], top1])
    val = torch.cat([credit.val[keep] * decay, gain])
    keys, inverse = torch.unique(pos * vocab + tok, return_inverse=True)  # coalesce: one entry per (pos, tok)
    merged = torch.zeros(keys.shape[0], dtype=torch.float32, device=val.device).index_add_(0, inverse, val)
    return CreditState(pos=keys // vocab, tok=keys % vocab, val=merged)


def fuse_credit(logits: Tensor, positions: Tensor, credit: CreditState, weight: float) -> Tensor:
    """fused = logits + weight * log(1 + C), reading C at each row's position (a copy; logits untouched)."""
    row = (credit.pos.unsqueeze(1) == positions.unsqueeze(0)).int().argmax(dim=1)  # all entries are live positions
    fused = logits.clone()
    fused.index_put_((row, credit.tok), weight * torch.log1p(credit.val), accumulate=True)
    return fused


# ----------------------------------------------------------------------------------------------------------------
# Rules: (cfg, proposal, state, generator) -> commit [M] bool.


def low_confidence(cfg: PolicyConfig, prop: Proposal, state: BlockState, generator: torch.Generator | None) -> Tensor:
    """LLaDA fixed schedule, most confident first (ML-GSAI/LLaDA generate.py, remasking="low_confidence").

    1. steps = cfg.steps (None: one per initially masked token).
    2. quota = even_split(initial_masked, steps)[step]; on the last scheduled step or later, all remaining.
    3. Clamp the quota to [1, M] and commit the quota rows with the highest p(x0).
    """
    return top_rows(prop.probs, _llada_quota(cfg, state, prop.probs.shape[0]))


def random_order(cfg: PolicyConfig, prop: Proposal, state: BlockState, generator: torch.Generator | None) -> Tensor:
    """LLaDA fixed schedule, random order (remasking="random").

    1. quota as in `low_confidence`.
    2. Draw one U[0, 1) per row from the generator; commit the quota rows with the highest draws.
    """
    m = prop.probs.shape[0]
    return top_rows(uniform(m, generator, prop.probs.device), _llada_quota(cfg, state, m))


def _llada_quota(cfg: PolicyConfig, state: BlockState, m: int) -> int:
    steps = block_steps(cfg, state)
    if state.step >= steps - 1:
        return m
    return clamp_count(even_split_at(state.initial_masked, steps, state.step), m)


def threshold(cfg: PolicyConfig, prop: Proposal, state: BlockState, generator: torch.Generator | None) -> Tensor:
    """Fast-dLLM v1 / dInfer parallel threshold (arXiv 2505.22618).

    1. Commit every row with p(x0) >= cfg.threshold.
    2. Always add the single most confident row.
    """
    return threshold_mask(prop.probs, cfg.threshold)


def factor(cfg: PolicyConfig, prop: Proposal, state: BlockState, generator: torch.Generator | None) -> Tensor:
    """Fast-dLLM v1 factor rule (arXiv 2505.22618).

    1. Sort p(x0) descending: c_1 >= c_2 >= ...
    2. n = largest count with c_i >= 1 - factor / (i + 1) for every i <= n (c_1 always passes).
    3. Commit those n rows.
    """
    return top_rows(prop.probs, factor_count(prop.probs, cfg.factor))


def _dream_select(cfg: PolicyConfig, conf: Tensor, state: BlockState, generator: torch.Generator | None) -> Tensor:
    """Dream's count schedule applied to `conf`: top-n, or n sampled rows when alg_temp > 0.

    The count is clamped to [1, M], or with `empty_steps` to [0, M] as the reference leaves it (n = 0: nothing)."""
    m = conf.shape[0]
    n = dream_count(m, state.step, block_steps(cfg, state))
    n = min(n, m) if cfg.empty_steps else clamp_count(n, m)
    if n == 0:
        return torch.zeros_like(conf, dtype=torch.bool)
    if cfg.alg_temp > 0 and n < m:
        return sample_rows(conf, n, cfg.alg_temp, generator)
    return top_rows(conf, n)


def maskgit_plus(cfg: PolicyConfig, prop: Proposal, state: BlockState, generator: torch.Generator | None) -> Tensor:
    """Dream alg="maskgit_plus" (DreamLM/Dream generation_utils).

    1. steps = cfg.steps (None: one per initially masked token); t, s from linspace(1, 1e-3, steps + 1).
    2. n = int(M * (1 - s/t)), all on the last step; clamped to [1, M] (Dream allows 0, and so does `empty_steps`).
    3. confidence = p(x0); commit the top-n, or sample n rows from softmax(conf / alg_temp) when alg_temp > 0.
    """
    return _dream_select(cfg, prop.probs, state, generator)


def topk_margin(cfg: PolicyConfig, prop: Proposal, state: BlockState, generator: torch.Generator | None) -> Tensor:
    """Dream alg="topk_margin": as `maskgit_plus` with confidence = p1 - p2.

    1. n from Dream's schedule, clamped to [1, M].
    2. confidence = margin; top-n or alg_temp sampling.
    """
    return _dream_select(cfg, prop.margin, state, generator)


def neg_entropy(cfg: PolicyConfig, prop: Proposal, state: BlockState, generator: torch.Generator | None) -> Tensor:
    """Dream alg="entropy": as `maskgit_plus` with confidence = -entropy (sum p log p).

    1. n from Dream's schedule, clamped to [1, M].
    2. confidence = negative entropy; top-n or alg_temp sampling.
    """
    return _dream_select(cfg, -prop.entropy, state, generator)


def origin(cfg: PolicyConfig, prop: Proposal, state: BlockState, generator: torch.Generator | None) -> Tensor:
    """Dream alg="origin": every masked row reveals independently with probability 1 - s/t (1 on the last step).

    1. p = dream_reveal_prob(step, steps).
    2. Draw u ~ U[0, 1) per row; commit rows with u < p.
    3. Unless `empty_steps` (Dream's own rule, a forward revealing nothing): if no row was drawn, commit the row
       with the smallest u (a uniformly random row), so that every step progresses.
    """
    m = prop.probs.shape[0]
    u = uniform(m, generator, prop.probs.device)
    commit = u < dream_reveal_prob(state.step, block_steps(cfg, state))
    if not cfg.empty_steps:
        commit[u.argmin()] = True
    return commit


def entropy_bounded(cfg: PolicyConfig, prop: Proposal, state: BlockState,
                    generator: torch.Generator | None) -> Tensor:
    """Entropy-bounded unmasking (arXiv 2505.24857; SDAR "entropy_bounded", DiffusionGemma).

    1. Sort rows by entropy ascending: H_1 <= H_2 <= ...
    2. k = largest count with sum(H_1..H_k) - max(H_1..H_k) <= entropy_bound (at least 1).
    3. Commit those k lowest-entropy rows.
    """
    return top_rows(-prop.entropy, entropy_bound_count(prop.entropy, cfg.entropy_bound))


def credit(cfg: PolicyConfig, prop: Proposal, state: BlockState, generator: torch.Generator | None) -> Tensor:
    """dInfer credit decoding (arXiv 2510.06133); the credit fusion already happened in `decide`.

    1. (decide) C <- credit_decay * C; C[pos, top1] += p_top1 ** credit_gamma for every masked row.
    2. (decide) fused logits = logits + credit_weight * log(1 + C); the proposal comes from them.
    3. Threshold rule on the fused distribution: p(x0) >= threshold, plus the most confident row.
    """
    return threshold_mask(prop.probs, cfg.threshold)


def topk(cfg: PolicyConfig, prop: Proposal, state: BlockState, generator: torch.Generator | None) -> Tensor:
    """Fixed k per step; k = 1 is the one-token-per-forward baseline.

    1. k = tokens_per_step (None: 1), clamped to [1, M].
    2. Commit the k rows with the highest p(x0).
    """
    return top_rows(prop.probs, clamp_count(cfg.tokens_per_step or 1, prop.probs.shape[0]))


def learned(cfg: PolicyConfig, prop: Proposal, positions: Tensor, state: BlockState) -> Tensor:
    """The model's learned commit filter (unmask.decoding.commit_filter; Learn2PD's idea, arXiv 2509.25188).

    1. Features per row: logit of p(x0), p1 - p2, entropy, log(1 + distance from the leftmost masked row), and
       the share of the block's initial masks still masked.
    2. Commit every row the filter predicts final with probability >= cfg.threshold, plus the most likely row.
    """
    if cfg.commit_filter is None:
        raise ValueError("policy 'learned' needs the model's commit_filter (fit one with `unmask calibrate`)")
    feats = features(prop.probs, prop.margin, prop.entropy, positions.to(prop.probs.device), state.initial_masked)
    return commit_rows(cfg.commit_filter, feats, cfg.threshold)


POLICIES: dict[str, Rule] = {
    "low_confidence": low_confidence,
    "random": random_order,
    "threshold": threshold,
    "factor": factor,
    "maskgit_plus": maskgit_plus,
    "topk_margin": topk_margin,
    "entropy": neg_entropy,
    "origin": origin,
    "entropy_bounded": entropy_bounded,
    "credit": credit,
    "topk": topk,
}
