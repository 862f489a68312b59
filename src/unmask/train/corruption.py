"""Random-token corruption mixed into the masking noise, so that a model learns to replace wrong tokens.

The edit rules of decoding (`unmask.decoding.edits`, docs/decoding.md "Editing committed tokens") replace a filled
position of the active block when the model proposes another token with high probability. A model trained only
on masks never sees a wrong token in its input, so nothing teaches it that proposal (issue 35). LLaDA2.1 (arXiv
2602.08676) trains its token-to-token editing on random vocabulary corruptions alongside the masks (as arXiv
2606.17175 describes the released recipe); this is that form:

- a share `corrupt_fraction` of the noised positions (drawn independently, after the masks, from the same
  generator) hold a uniformly random token instead of the mask: never the mask token, never the right token;
- the loss covers them as it covers the masks (cross-entropy of the right token, weighted by 1/p);
- and it covers the other filled positions of the noisy stream with weight 1 (the *keep* term): the model cannot
  tell a planted token from a right one by looking at it, so without this term it would learn that a filled token
  is always wrong and propose to replace every one. A shifted model's block-first position is read from the clean
  row before the block (as decoding reads it, at every step of the block), which sees no token of the block: it is
  left out of the keep term.

Only the noisy stream is corrupted; the clean stream of block diffusion (the exact KV cache of committed blocks at
inference) stays clean, as edits never reach a settled block.
"""
from __future__ import annotations

import torch
from torch import Tensor


def draw_corruption(masked: Tensor, x0: Tensor, fraction: float, vocab_size: int, mask_id: int,
                    gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """(corrupt [B, L] bool: the noised positions that hold a random token, tokens [B, L] long: that token there,
    the right one elsewhere). Each noised position is corrupted with probability `fraction`; its token is uniform
    over the vocabulary less the mask token and the right token (x0, on the CPU)."""
    B, L = masked.shape
    corrupt = masked & (torch.rand(B, L, generator=gen) < fraction)
    x0 = x0.cpu()
    r = torch.randint(vocab_size - 2, (B, L), generator=gen)  # one of V - 2 values, then stepped past the two
    lo, hi = torch.minimum(x0, torch.full_like(x0, mask_id)), torch.maximum(x0, torch.full_like(x0, mask_id))
    hi = torch.where(hi == lo, torch.full_like(hi, vocab_size), hi)  # x0 == mask id: only one value to skip
    r = r + (r >= lo).long()
    r = r + (r >= hi).long()
    return corrupt, torch.where(corrupt, r, x0)


def keep_positions(eligible: Tensor, masked: Tensor, block_size: int | None, shift: bool) -> Tensor:
    """[B, L] bool: the loss-eligible positions that stay filled in the noisy stream and whose predicting row is a
    noisy one (a shifted model reads a block's first token from the clean row before it)."""
    keep = eligible & ~masked
    if shift and block_size is not None:
        keep[:, ::block_size] = False
    return keep
