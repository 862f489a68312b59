"""The held-out masked-token loss computed through the engine's KV cache, to measure what a cache dtype costs.

`evaluation.masked_token_loss` runs the training forward ([x_t ; x_0] under the block-diffusion mask), which
keeps no cache, so a cache dtype cannot change it. Here each clean row is prefilled into a KVCache of the
chosen dtype (as the engine prefills a prompt), then every noised block is read over that cache in one
forward: the blocks go last to first, so the K/V each block writes into the cache (scratch, as the engine's
active block) only covers positions that the blocks after it in the forward never read. With a cache in the
weights' dtype this equals `masked_token_loss` up to float rounding (tested); with bfloat16 K/V the difference
is the cache's rounding alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from unmask.engine.llm import LLM
from unmask.models.attention import AttentionBatch, Segment, commit_cache_lengths


def cached_masked_token_loss(llm: LLM, docs, block_size: int, kv_dtype: torch.dtype | None = None,
                             seq_len: int = 512, max_rows: int = 32, seed: int = 0) -> float:
    """`masked_token_loss` (same rows, same noise for the same seed) read through a `kv_dtype` cache."""
    from unmask.train.data import pack_documents
    from unmask.train.objectives import Objective, draw_noise

    spec, model = llm.spec, llm.model
    if spec.family.attention != "block_causal" or spec.family.sequence_class is not None:
        raise ValueError(f"the cached loss needs a block-causal family with an exact cache, not {spec.family.name}")
    sep = llm.tokenizer.token_id("<|endoftext|>")
    sep = sep if sep is not None else spec.eos_id
    rows = pack_documents((llm.tokenizer.encode(d.text) for d in docs), seq_len, sep).ids[:max_rows].long()
    obj = Objective(mask_id=spec.mask_id, block_sizes=(block_size,), shift=spec.shift,
                    causal_context=spec.causal_context)
    gen = torch.Generator().manual_seed(seed)
    device = model.lm_head.weight.device
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, rows.shape[0], 8):  # the noise is drawn per 8 rows, as masked_token_loss draws it
            x0 = rows[i:i + 8]
            noise = draw_noise(obj, torch.ones_like(x0, dtype=torch.bool), gen)
            for b in range(x0.shape[0]):
                total += _row_loss(model, x0[b].to(device), noise.masked[b].to(device), noise.p[b].to(device),
                                   block_size, spec, kv_dtype)
                count += x0.shape[1]
    return total / max(count, 1)


def _row_loss(model, x0, masked, p, B: int, spec, kv_dtype) -> float:
    L = x0.shape[0]
    pos = torch.arange(L, device=x0.device)
    cache = model.new_cache(capacity=L, dtype=kv_dtype)
    clean_ids = pos if spec.causal_context else pos // B  # the engine's prompt mask
    batch = AttentionBatch([Segment(0, L, write=L, cache=cache, block_ids=clean_ids)]).prepare()
    clean = model(x0, pos, batch)  # [L, D]
    commit_cache_lengths(batch)
    starts = list(range(0, L, B))[::-1]
    xt = torch.where(masked, torch.full_like(x0, spec.mask_id), x0)
    segments = [Segment(s, min(B, L - s), cache=cache, block_ids=torch.zeros(min(B, L - s), dtype=torch.long,
                                                                               device=x0.device))
                for s in starts]
    ids = torch.cat([xt[s:s + B] for s in starts])
    noised = model(ids, torch.cat([pos[s:s + B] for s in starts]), AttentionBatch(segments).prepare())
    row_of = torch.empty(L, dtype=torch.long, device=x0.device)  # position -> its row in `noised`
    row_of[torch.cat([pos[s:s + B] for s in starts])] = torch.arange(L, device=x0.device)
    j = masked.nonzero(as_tuple=True)[0]
    if spec.shift:  # token j is read from row j - 1; a block's first token from the clean row before it
        j = j[j > 0]
        hidden = torch.where((j % B == 0)[:, None], clean[j - 1], noised[row_of[j - 1]])
    else:
        hidden = noised[row_of[j]]
    if not j.numel():
        return 0.0
    logits = model.logits(hidden)
    return float((F.cross_entropy(logits, x0[j], reduction="none") / p[j]).sum())
