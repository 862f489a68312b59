"""Masked-diffusion training objectives: the plain MDM loss and its block-diffusion form.

Plain (LLaDA, arXiv 2502.09992; MDLM, arXiv 2406.07524): draw t ~ U(0, 1), mask every
loss-eligible token independently with probability p = (1 - eps) t + eps, and score the masked
positions with cross-entropy weighted by 1/p over one fully bidirectional pass.

Block diffusion (BD3-LM, arXiv 2503.09573; SDAR; Fast-dLLM v2): the model reads [x_t ; x_0]
(2L tokens, both halves at positions 0..L-1) under `block_diffusion_mask`, so one pass scores
every block of x_t as if the blocks before it had been generated already, which is exactly what
block-by-block inference with a KV cache of committed blocks sees.

Causal context (`causal_context=True`, needs shift): the clean stream x_0 attends causally, token by
token, instead of block-causally, so the committed text's K/V are those of a left-to-right model and
every clean row is a next-token predictor; `next_token_weight` > 0 adds that next-token loss over all
eligible tokens (for the cost of the LM head on those rows) so the block-diffusion phase of an
AR-initialised model keeps the left-to-right path its base learned. The noisy stream is unchanged: its
block reads itself bidirectionally and the clean rows of strictly earlier blocks. Inference writes the
committed blocks' K/V under the same causal rule (`unmask.engine.sequence`). The same split, a causal
writer of the cache and a bidirectional reader of it, is DiffusionGemma's (transformers
`DiffusionGemmaForBlockDiffusion`).

Causal (`causal=True`): plain next-token training of the same network under left-to-right
attention, no noise. It trains the base of an AR-initialised diffusion model (Fast-dLLM v2,
arXiv 2509.26328; SDAR; Dream), which then continues with shifted block diffusion: the causal
base already predicts token i+1 at row i, the reading a shifted objective keeps.

Both return the *sum* of weighted CE; the caller divides by the number of loss-eligible tokens
of the whole global batch so that gradient accumulation and data parallelism give the same
number as one big batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor

from unmask.models.transformer import CAUSAL, DiffusionTransformer
from unmask.models.two_stream import TwoStreamLayout, use_two_stream
from unmask.train.corruption import draw_corruption, keep_positions

EPS = 1e-3


@dataclass(frozen=True)
class Objective:
    mask_id: int
    # None: one bidirectional pass over x_t (LLaDA, Dream). Otherwise block diffusion over
    # [x_t ; x_0] with a block size drawn per batch from this set, so that inference works at
    # any of them (the block size is a per-request setting in the engine).
    block_sizes: tuple[int, ...] | None = None
    shift: bool = False         # logits at i predict token i+1 (Dream, Fast-dLLM v2)
    eps: float = EPS
    t_per_block: bool = True    # one t per block (BD3-LM, Fast-dLLM v2) instead of per sequence (SDAR)
    stratified_t: bool = True   # low-discrepancy t over the batch (MDLM): same mean, less variance
    causal: bool = False        # next-token training under causal attention (no noise; needs shift)
    causal_context: bool = False  # clean stream attends token-causally (block diffusion with shift only)
    next_token_weight: float = 0.0  # weight of the clean stream's next-token loss (causal_context only)
    # share of blocks whose masked set is the block's last ceil(t B) positions instead of an iid draw: the
    # clean-prefix, masked-suffix pattern that left-to-right-leaning decoding (threshold, credit) meets
    suffix_fraction: float = 0.0
    # share of blocks masked whole (t = 1): the draft block of self-speculative decoding reads nothing of itself
    # (TiDAR trains its draft region fully masked for the same reason; engine/speculative.py)
    full_block_fraction: float = 0.0
    # certainty forcing (dParallel, czg1225/dParallel): plus this weight times the entropy of the prediction at
    # every masked position the model already gets right, so confidence rises on many positions at once
    confidence_weight: float = 0.0
    # share of the noised positions that hold a random token of [0, vocab_size) instead of the mask, scored like the
    # masks, with the other filled positions of the noisy stream scored too (corruption.py): edits learn to replace
    corrupt_fraction: float = 0.0
    vocab_size: int = 0
    # keeping the verifier: plus this weight times KL(anchor || model) on the clean rows' next-token predictions,
    # the anchor being a frozen copy of the starting model. With a causal context those rows are what policy
    # speculative's output is read from; a drafter trained on its own answers otherwise sharpens them and loses
    # held-out score (docs/training.md). Medusa-2 holds its backbone the same way (arXiv 2401.10774, self-distillation).
    anchor_weight: float = 0.0
    # PoSE (positional skip-wise training, arXiv 2309.10400): each row's positions are cut at a random point and the
    # part after it shifted by a random skip, so rows of L tokens train relative distances up to this span; 0: off
    position_span: int = 0

    def __post_init__(self):
        if self.position_span < 0:
            raise ValueError(f"position_span must be >= 0, got {self.position_span}")
        if self.causal_context and (self.block_sizes is None or not self.shift or self.causal):
            raise ValueError("causal_context is a form of shifted block diffusion (block_sizes and shift=True)")
        if not 0.0 <= self.suffix_fraction <= 1.0:
            raise ValueError(f"suffix_fraction must be in [0, 1], got {self.suffix_fraction}")
        if self.suffix_fraction and (self.block_sizes is None or not self.t_per_block):
            raise ValueError("suffix_fraction shapes each block's mask: it needs block_sizes and t_per_block")
        if not 0.0 <= self.full_block_fraction <= 1.0:
            raise ValueError(f"full_block_fraction must be in [0, 1], got {self.full_block_fraction}")
        if self.full_block_fraction and (self.block_sizes is None or not self.t_per_block):
            raise ValueError("full_block_fraction masks whole blocks: it needs block_sizes and t_per_block")
        for name in ("next_token_weight", "anchor_weight"):
            if getattr(self, name) and not self.causal_context:
                raise ValueError(f"{name} scores the clean stream's next-token rows: it needs causal_context")
        if self.causal and (not self.shift or self.block_sizes is not None):
            raise ValueError("a causal objective reads row i for token i+1 (shift=True) and has no blocks")
        if not self.confidence_weight >= 0.0:
            raise ValueError(f"confidence_weight must be >= 0, got {self.confidence_weight}")
        if self.confidence_weight and self.causal:
            raise ValueError("confidence_weight sharpens masked predictions; a causal objective masks nothing")
        if not 0.0 <= self.corrupt_fraction <= 1.0:
            raise ValueError(f"corrupt_fraction must be in [0, 1], got {self.corrupt_fraction}")
        if self.corrupt_fraction and (self.causal or self.vocab_size < 3):
            raise ValueError("corrupt_fraction puts random tokens of vocab_size (>= 3) where masks would be; "
                             "a causal objective masks nothing")
        if self.block_sizes is not None and (not self.block_sizes or min(self.block_sizes) < 1):
            raise ValueError(f"block_sizes must be positive, got {self.block_sizes}")

    def describe(self) -> str:
        """One line for the trainer's start-up log."""
        if self.causal:
            return "causal next-token"
        kind = f"block diffusion {self.block_sizes}" if self.block_sizes else "bidirectional masked diffusion"
        kind += ", shifted logits" if self.shift else ""
        if self.causal_context:
            kind += ", causal context" + (f" + next-token loss x{self.next_token_weight:g}"
                                          if self.next_token_weight else "")
        for share, what in ((self.suffix_fraction, "of blocks masked as a tail"),
                            (self.full_block_fraction, "of blocks masked whole"),
                            (self.corrupt_fraction, "of noised positions a random token")):
            kind += f", {share:.0%} {what}" if share else ""
        if self.confidence_weight:
            kind += f", certainty forcing x{self.confidence_weight:g}"
        if self.anchor_weight:
            kind += f", next-token rows held to the starting model (KL x{self.anchor_weight:g})"
        if self.position_span:
            kind += f", positions skipped over a span of {self.position_span:,} (PoSE)"
        if (self.next_token_weight or self.suffix_fraction or self.confidence_weight or self.full_block_fraction
                or self.corrupt_fraction or self.anchor_weight):
            kind += " (eval: diffusion loss, independent masks)"
        return kind


@dataclass
class Noise:
    """One batch's corruption: which tokens are noised and with what probability; with `Objective.corrupt_fraction`,
    which of them hold a random token instead of the mask (corruption.py)."""

    block_size: int | None
    masked: Tensor  # [B, L] bool: noised (masked or, where `corrupt`, a random token), scored with weight 1/p
    p: Tensor       # [B, L] float32, masking probability of each position
    corrupt: Tensor | None = None  # [B, L] bool, within `masked`
    tokens: Tensor | None = None   # [B, L] long: the random token where `corrupt`
    keep: Tensor | None = None     # [B, L] bool: filled positions of the noisy stream, scored with weight 1
    positions: Tensor | None = None  # [B, L] long: each token's RoPE position with `Objective.position_span`

    def rows(self, sl: slice) -> "Noise":
        part = [None if t is None else t[sl] for t in (self.corrupt, self.tokens, self.keep, self.positions)]
        return Noise(self.block_size, self.masked[sl], self.p[sl], *part)


def block_diffusion_mask(length: int, block_size: int, causal_context: bool = False) -> Tensor:
    """[2L, 2L] bool (True = may attend) over [x_t ; x_0].

    noisy q -> noisy k of its own block, and clean k of strictly earlier blocks;
    clean q -> clean k of its own and earlier blocks (block-causal), or of earlier positions and itself
    (`causal_context`); clean q never sees noise.
    """
    return _bd_mask(length, block_size, causal_context).clone()


@lru_cache(maxsize=32)
def _bd_mask(length: int, block_size: int, causal_context: bool = False) -> Tensor:
    return _build_bd_mask(length, block_size, causal_context, torch.device("cpu"))


def _mask_on(dev: torch.device, length: int, block_size: int, causal_context: bool) -> Tensor:
    """The [2L, 2L] mask on `dev`: cached on the CPU; elsewhere built there each step (a few elementwise kernels)
    rather than copied from the host (4.3 GB a step at L = 32K) or cached on the device (one per length and
    block size)."""
    if dev.type == "cpu":
        return _bd_mask(length, block_size, causal_context)
    return _build_bd_mask(length, block_size, causal_context, dev)


def _build_bd_mask(length: int, block_size: int, causal_context: bool, dev: torch.device) -> Tensor:
    pos = torch.arange(length, device=dev)
    blk = pos // block_size
    bq, bk = blk[:, None], blk[None, :]
    noisy_noisy = bq == bk
    noisy_clean = bk < bq
    clean_clean = pos[None, :] <= pos[:, None] if causal_context else bk <= bq
    top = torch.cat([noisy_noisy, noisy_clean], dim=1)
    bottom = torch.cat([torch.zeros_like(clean_clean), clean_clean], dim=1)
    return torch.cat([top, bottom], dim=0)


def loss_eligible(loss_mask: Tensor, shift: bool) -> Tensor:
    """Positions that may be noised and scored; with shifted logits position 0 has no predictor."""
    if not shift:
        return loss_mask
    out = loss_mask.clone()
    out[:, 0] = False
    return out


def draw_noise(obj: Objective, loss_mask: Tensor, gen: torch.Generator, x0: Tensor | None = None) -> Noise:
    """`_draw_masks`, then with `obj.position_span` the rows' skipped positions, drawn last so that runs without
    them keep their noise."""
    noise = _draw_masks(obj, loss_mask, gen, x0)
    if obj.position_span:
        noise.positions = skipped_positions(*loss_mask.shape, obj.position_span, gen)
    return noise


def skipped_positions(rows: int, length: int, span: int, gen: torch.Generator) -> Tensor:
    """[rows, length] positions as PoSE trains them with two chunks (arXiv 2309.10400): per row a cut c in
    [1, length) and a skip s in [0, span - length]; tokens before c keep positions 0..c-1, the rest move to
    c+s..length-1+s. The text stays contiguous, only its distances grow, so a row of `length` tokens teaches
    distances up to `span` - 1 at the cost of `length`."""
    if span < length:
        raise ValueError(f"position_span {span} is shorter than the rows ({length} tokens)")
    pos = torch.arange(length).expand(rows, length).clone()
    if length < 2:
        return pos
    cut = torch.randint(1, length, (rows, 1), generator=gen)
    skip = torch.randint(0, span - length + 1, (rows, 1), generator=gen)
    return pos + torch.where(pos >= cut, skip, torch.zeros_like(skip))


def _draw_masks(obj: Objective, loss_mask: Tensor, gen: torch.Generator, x0: Tensor | None = None) -> Noise:
    """Sample a block size, t and the mask for a [B, L] batch; positions with loss_mask False
    (SFT prompts) are never noised. All randomness comes from `gen`, on the CPU, so every
    data-parallel rank draws the same global noise and takes its own rows. `x0` (the batch) is needed with
    `obj.corrupt_fraction`: a random token is never the right one."""
    B, L = loss_mask.shape
    if obj.causal:  # every eligible token is scored, with weight 1 (p = 1)
        return Noise(None, loss_eligible(loss_mask.cpu(), True), torch.ones(B, L))
    bs = None
    if obj.block_sizes is not None:
        bs = obj.block_sizes[int(torch.randint(len(obj.block_sizes), (1,), generator=gen))]
    per_row = -(-L // bs) if (bs is not None and obj.t_per_block) else 1
    n = B * per_row
    if obj.stratified_t:  # t_i = (u + i/n) mod 1, then shuffled so strata do not follow row order
        t = (torch.rand(1, generator=gen) + torch.arange(n) / n) % 1.0
        t = t[torch.randperm(n, generator=gen)]
    else:
        t = torch.rand(n, generator=gen)
    t = t.view(B, per_row)
    if per_row > 1:
        t = t.repeat_interleave(bs, dim=1)[:, :L]
    p = ((1 - obj.eps) * t + obj.eps).expand(B, L).contiguous()
    u = torch.rand(B, L, generator=gen)
    masked = u < p
    if obj.suffix_fraction:  # chosen blocks mask their tail: offset >= B - ceil(t B), about the share t
        suffix = (torch.rand(B, per_row, generator=gen) < obj.suffix_fraction).repeat_interleave(bs, dim=1)[:, :L]
        offset = torch.arange(L) % bs
        tail = offset >= bs - torch.ceil(p * bs)
        masked = torch.where(suffix, tail, masked)
    if obj.full_block_fraction:  # drawn after the rest, so runs without it keep their noise
        full = (torch.rand(B, per_row, generator=gen) < obj.full_block_fraction).repeat_interleave(bs, dim=1)[:, :L]
        masked = masked | full
        p = torch.where(full, torch.ones_like(p), p)
    eligible = loss_eligible(loss_mask.cpu(), obj.shift)
    masked = masked & eligible
    if not obj.corrupt_fraction:
        return Noise(bs, masked, p)
    if x0 is None:
        raise ValueError("corrupt_fraction draws tokens other than the right ones: draw_noise needs x0")
    corrupt, tokens = draw_corruption(masked, x0, obj.corrupt_fraction, obj.vocab_size, obj.mask_id, gen)
    return Noise(bs, masked, p, corrupt, tokens, keep_positions(eligible, masked, bs, obj.shift))


def certainty_sum(logits: Tensor, target: Tensor) -> Tensor:
    """Sum of the predictive entropy over the rows whose argmax already is the target ([N, V], [N]). Rows the
    model gets wrong are left to the cross-entropy: sharpening them would entrench the mistake (dParallel)."""
    right = logits.detach().argmax(-1) == target
    if not bool(right.any()):
        return logits.sum() * 0.0
    logp = F.log_softmax(logits[right], dim=-1)
    return -(logp.exp() * logp).sum()


def masked_rows(model: DiffusionTransformer, x0: Tensor, masked: Tensor, obj: Objective,
                block_size: int | None, noise: Noise | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One pass over the noised batch: (hidden states, then b, j, src: for each masked position (b, j) the hidden
    row that predicts it). Block diffusion reads [x_t ; x_0] under `block_diffusion_mask`, so each block's masked
    positions see exactly what block-by-block inference with an exact cache sees. A `noise` with corruption puts
    its random tokens in x_t where it corrupts."""
    B, L = x0.shape
    dev = x0.device
    filled = x0 if noise is None or noise.corrupt is None else noise.tokens.to(dev)
    hide = masked if noise is None or noise.corrupt is None else masked & ~noise.corrupt.to(dev)
    xt = torch.where(hide, torch.full_like(x0, obj.mask_id), filled)
    if noise is not None and noise.positions is not None:
        pos = noise.positions.to(dev)
    else:
        pos = torch.arange(L, device=dev).expand(B, L)
    if obj.causal:
        hidden = model.forward_dense(x0, pos, CAUSAL)  # [B, L, D]; `masked` marks the scored tokens
    elif block_size is None:
        hidden = model.forward_dense(xt, pos, None)  # [B, L, D], bidirectional
    else:
        if use_two_stream(L, block_size):  # the same attention without the [2L, 2L] mask (models/two_stream.py)
            attn = TwoStreamLayout(L, block_size, obj.causal_context)
        else:
            attn = _mask_on(dev, L, block_size, obj.causal_context)[None, None]
        hidden = model.forward_dense(torch.cat([xt, x0], 1), torch.cat([pos, pos], 1), attn)  # [B, 2L, D]
    b, j = masked.nonzero(as_tuple=True)
    return hidden, b, j, source_rows(j, obj, block_size, L)


def source_rows(j: Tensor, obj: Objective, block_size: int | None, length: int) -> Tensor:
    """The hidden row that predicts position j of the noisy stream."""
    if not obj.shift:
        return j
    # token j is read from row j-1; a block's first token from the clean row j-1, as in Fast-dLLM v2 inference
    # where it comes from the previous block's commit pass
    src = j - 1
    if block_size is not None and not obj.causal:
        src = torch.where(j % block_size == 0, length + j - 1, src)
    return src


def bucket_rows(n: int) -> int:
    """n rounded up to one of 8 sizes per doubling (at most 1/8 more): the row counts a training step sends
    through the LM head."""
    if n <= 64:
        return n
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


def head_logits(model: DiffusionTransformer, rows: Tensor) -> Tensor:
    """model.logits over `rows` [N, D], computed over a count of rows that repeats from step to step (zero rows
    added, their logits dropped). Why: the masked rows a step scores vary in number, and on the CPU each new count
    is a new oneDNN matmul (bf16) for the head and its two gradients, which oneDNN caches (up to 1,024 of them);
    the distillation's memory grew with them by megabytes a step (docs/training.md, "Memory")."""
    n = rows.shape[0]
    if rows.device.type != "cpu" or n == bucket_rows(n):
        return model.logits(rows)
    padded = torch.cat([rows, rows.new_zeros(bucket_rows(n) - n, rows.shape[1])])
    return model.logits(padded)[:n]


def diffusion_loss_sum(model: DiffusionTransformer, x0: Tensor, noise: Noise, obj: Objective,
                       eligible: Tensor | None = None, anchor: DiffusionTransformer | None = None) -> Tensor:
    """Sum over masked positions of CE(x0) / p (causal: over scored positions, p = 1), plus with corruption the
    CE of the other filled positions of the noisy stream (`noise.keep`). Only those rows go through the LM head. With `obj.next_token_weight` > 0, plus that weight times the next-token CE of
    every `eligible` token ([B, L] bool, shifted: j >= 1) read from the clean row before it; with
    `obj.anchor_weight` > 0 and an `anchor` model, plus that weight times KL(anchor || model) on those rows."""
    L = x0.shape[1]
    dev = x0.device
    masked, p = noise.masked.to(dev), noise.p.to(dev)
    hidden, b, j, src = masked_rows(model, x0, masked, obj, noise.block_size, noise)
    total = model.logits(hidden[:1, 0]).sum() * 0.0  # keeps every parameter in the graph (DDP) with no rows
    if b.numel():
        logits = head_logits(model, hidden[b, src])  # [N, V] float32
        total = total + (F.cross_entropy(logits, x0[b, j], reduction="none") / p[b, j]).sum()
        if obj.confidence_weight:
            total = total + obj.confidence_weight * certainty_sum(logits, x0[b, j])
    if noise.keep is not None:  # corruption: the filled positions are scored too, weight 1 (corruption.py)
        kb, kj = noise.keep.to(dev).nonzero(as_tuple=True)
        if kb.numel():
            ksrc = source_rows(kj, obj, noise.block_size, L)
            total = total + F.cross_entropy(head_logits(model, hidden[kb, ksrc]), x0[kb, kj], reduction="sum")
    anchored = bool(obj.anchor_weight) and anchor is not None
    if (obj.next_token_weight or anchored) and eligible is not None:
        eb, ej = eligible.to(dev).nonzero(as_tuple=True)
        if eb.numel():
            logits = head_logits(model, hidden[eb, L + ej - 1])
            if obj.next_token_weight:
                total = total + obj.next_token_weight * F.cross_entropy(logits, x0[eb, ej], reduction="sum")
            if anchored:
                total = total + obj.anchor_weight * anchor_kl_sum(anchor, x0, eb, ej - 1, logits)
    return total


def anchor_kl_sum(anchor: DiffusionTransformer, x0: Tensor, b: Tensor, row: Tensor, logits: Tensor) -> Tensor:
    """Sum over the rows (b, row) of KL(anchor || model), `logits` being the model's there ([N, V]). With a causal
    context the clean stream reads only clean tokens, token-causally, so the anchor's rows are one causal pass
    over x0 alone (half the positions of the two-stream pass), without gradients."""
    with torch.no_grad():
        pos = torch.arange(x0.shape[1], device=x0.device).expand_as(x0)
        target = F.log_softmax(head_logits(anchor, anchor.forward_dense(x0, pos, CAUSAL)[b, row]).float(), dim=-1)
    return F.kl_div(F.log_softmax(logits.float(), dim=-1), target, log_target=True, reduction="sum")
