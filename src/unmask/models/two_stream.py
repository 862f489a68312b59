"""Block-diffusion training attention over [x_t ; x_0] without the dense [2L, 2L] mask.

The training pass of block diffusion (unmask.train.objectives) reads the noisy stream x_t and the clean stream x_0,
each of L tokens, in one sequence of 2L: a noisy row of block b sees the noisy rows of block b and the clean rows of
blocks before b; a clean row sees clean rows only, token-causally (`causal_context`) or block-causally. As one
boolean [2L, 2L] mask, SDPA scores all 4 L^2 pairs (a masked pair costs what a kept one does), and the mask itself is
4 GB at L = 32K. Split by what each row can see, the same attention costs about L^2 scores:

- the clean stream alone, token-causal: one SDPA with `is_causal`, whose kernels skip the upper triangle;
- each chunk of C rows (whole blocks) of the noisy stream, over the clean rows before the chunk's end and the
  chunk's own noisy rows: one SDPA under a [C, end + C] mask (and so for a block-causal clean stream).

Each row's softmax runs over exactly the keys the dense mask lets it see, so the output and its gradients are
the dense path's up to float rounding (tests/test_two_stream.py compares them). The chunk masks are the same in
every layer and are built once per layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK = 1024   # noisy rows a call; a [C, L + C] bool mask each (33 MB at L = 32K)


@dataclass(eq=False)
class TwoStreamLayout:
    """[x_t ; x_0], `length` tokens each, blocks of `block_size`; what `forward_dense` takes instead of the mask."""
    length: int
    block_size: int
    causal_context: bool
    chunk: int = CHUNK
    _masks: dict = field(default_factory=dict, repr=False)   # (stream, start, device) -> mask

    def __post_init__(self):
        self.chunk = max(self.block_size, self.chunk // self.block_size * self.block_size)

    def spans(self) -> list[tuple[int, int]]:
        return [(s, min(s + self.chunk, self.length)) for s in range(0, self.length, self.chunk)]

    def mask(self, stream: str, start: int, end: int, device: torch.device) -> Tensor:
        """The keys rows start..end-1 of `stream` see: noisy: clean [0, end) of earlier blocks, then noisy
        [start, end) of the same block; clean (block-causal): clean [0, end) of the same or earlier blocks."""
        key = (stream, start, device)
        if key not in self._masks:
            bs = self.block_size
            q_block = torch.arange(start, end, device=device)[:, None] // bs
            k_block = torch.arange(end, device=device)[None, :] // bs
            if stream == "noisy":
                own = torch.arange(start, end, device=device)[None, :] // bs
                self._masks[key] = torch.cat([k_block < q_block, own == q_block], dim=1)
            else:
                self._masks[key] = k_block <= q_block
        return self._masks[key]


def use_two_stream(length: int, block_size: int) -> bool:
    """Short rows keep the one dense mask: one kernel call, and the same numbers as every run made before."""
    return length > CHUNK and CHUNK % block_size == 0


@torch.compiler.disable   # a loop of SDPA calls under masks cached in Python: eager inside a compiled block
def two_stream_attention(q: Tensor, k: Tensor, v: Tensor, layout: TwoStreamLayout) -> Tensor:
    """q, k, v [B, H, 2L, D] (noisy rows first; k and v with as many heads as q) -> [B, H, 2L, D]."""
    L = layout.length
    qn, qc = q[..., :L, :], q[..., L:, :]
    kn, kc = k[..., :L, :], k[..., L:, :]
    vn, vc = v[..., :L, :], v[..., L:, :]
    noisy, clean = [], []
    for s, e in layout.spans():
        keys = torch.cat([kc[..., :e, :], kn[..., s:e, :]], dim=-2)
        values = torch.cat([vc[..., :e, :], vn[..., s:e, :]], dim=-2)
        noisy.append(F.scaled_dot_product_attention(qn[..., s:e, :], keys, values,
                                                    attn_mask=layout.mask("noisy", s, e, q.device)))
        if not layout.causal_context:
            clean.append(F.scaled_dot_product_attention(qc[..., s:e, :], kc[..., :e, :], vc[..., :e, :],
                                                        attn_mask=layout.mask("clean", s, e, q.device)))
    if layout.causal_context:
        clean = [F.scaled_dot_product_attention(qc, kc, vc, is_causal=True)]
    return torch.cat(noisy + clean, dim=-2)
