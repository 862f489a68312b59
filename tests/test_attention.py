"""Ragged attention's long-prefix path (prefix and own keys attended apart, merged by log-sum-exp) against
the single masked SDPA call it replaces."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from unmask.models import attention
from unmask.models.attention import AttentionBatch, KVCache, Segment, ragged_attention

pytestmark = pytest.mark.skipif(attention._CPU_FLASH is None, reason="torch without the CPU flash-attention op")


def _attend(q, k, v, start, block, dtype, split: bool, monkeypatch):
    monkeypatch.setattr(attention, "SPLIT_MIN_ELEMENTS", 0 if split else 1 << 62)
    hk, d = k.shape[1], k.shape[2]
    length = q.shape[0]
    cache = KVCache([(hk, d)], dtype, "cpu", capacity=start + length)
    cache.k[0][:, :start] = k[:start].transpose(0, 1)
    cache.v[0][:, :start] = v[:start].transpose(0, 1)
    cache.length = start
    pos = torch.arange(start, start + length)
    batch = AttentionBatch([Segment(start=start, length=length, write=length, cache=cache, block_ids=pos // block)])
    return ragged_attention(q, k[start:], v[start:], batch.prepare(), 0)


@pytest.mark.parametrize("start,length,block", [(100, 40, 8), (1003, 600, 8), (64, 1100, 32), (2000, 16, 4)])
def test_split_equals_single_masked_call(start, length, block, monkeypatch):
    g = torch.Generator().manual_seed(start + length)
    h, hk, d = 8, 4, 32
    q = torch.randn(length, h, d, generator=g)
    k = torch.randn(start + length, hk, d, generator=g) * 2
    v = torch.randn(start + length, hk, d, generator=g)
    ref = _attend(q, k, v, start, block, torch.float32, False, monkeypatch)
    out = _attend(q, k, v, start, block, torch.float32, True, monkeypatch)
    assert out.shape == ref.shape == (length, h, d)
    assert (out - ref).abs().max().item() < 1e-5

    # the hidden keys matter: a query must not see keys of its segment's later blocks
    k2, v2 = k.clone(), v.clone()
    k2[-1] += 5.0
    v2[-1] += 5.0
    out2 = _attend(q, k2, v2, start, block, torch.float32, True, monkeypatch)
    first_row_block = (start // block)
    last_block = (start + length - 1) // block
    if last_block > first_row_block:
        assert torch.equal(out2[0], out[0])
    assert not torch.equal(out2[-1], out[-1])


@pytest.mark.parametrize("start,committed", [(0, 200), (900, 300), (40, 64)])
def test_a_speculative_steps_causal_prefix_equals_the_one_masked_call(start, committed, monkeypatch):
    """A self-speculative step carrying a prompt's last chunk: its committed tokens and drafts (token-causal) go
    through the causal kernels apart from its draft blocks (explicit mask), with the same result as the one masked
    call over every key; the blocks' rows still see only what the layout lets them."""
    from unmask.engine.speculative import draft_layout

    g = torch.Generator().manual_seed(start + committed)
    drafts, blocks, outcomes = 3, [4, 4], [0, 3]
    attend = draft_layout(committed, drafts, blocks, outcomes)
    length, h, hk, d = attend.shape[0], 8, 4, 32
    q = torch.randn(length, h, d, generator=g)
    k = torch.randn(start + length, hk, d, generator=g) * 2
    v = torch.randn(start + length, hk, d, generator=g)

    def attend_with(prefix, k=k):
        cache = KVCache([(hk, d)], torch.float32, "cpu", capacity=start + length)
        cache.k[0][:, :start] = k[:start].transpose(0, 1)
        cache.v[0][:, :start] = v[:start].transpose(0, 1)
        cache.length = start
        seg = Segment(start=start, length=length, write=committed + drafts, cache=cache, attend=attend,
                      causal_prefix=prefix)
        return ragged_attention(q, k[start:], v[start:], AttentionBatch([seg]).prepare(), 0)

    split = []
    real = attention._attend_causal_prefix
    monkeypatch.setattr(attention, "_attend_causal_prefix", lambda *a: split.append(real(*a)) or split[-1])
    ref, out = attend_with(0), attend_with(committed + drafts)
    assert len(split) == 1 and split[0] is not None   # the prefix-less call never asks; the other took the split
    assert out.shape == (length, h, d)
    assert (out - ref).abs().max().item() < 1e-5
    # the second block shares positions with the first: no row before it sees its keys, its own rows do
    k2 = k.clone()
    k2[start + committed + drafts + 4:] += 5.0
    out2 = attend_with(committed + drafts, k2)
    assert torch.equal(out2[:committed + drafts + 4], out[:committed + drafts + 4])   # nobody before it sees it
    assert not torch.equal(out2[-1], out[-1])


def test_split_in_bfloat16_is_as_close_as_sdpa(monkeypatch):
    g = torch.Generator().manual_seed(0)
    start, length, block = 700, 520, 8
    q = torch.randn(length, 8, 32, generator=g)
    k = torch.randn(start + length, 4, 32, generator=g)
    v = torch.randn(start + length, 4, 32, generator=g)
    exact = _attend(q, k, v, start, block, torch.float32, False, monkeypatch)
    bq, bk, bv = q.bfloat16(), k.bfloat16(), v.bfloat16()
    sdpa = _attend(bq, bk, bv, start, block, torch.bfloat16, False, monkeypatch).float()
    split = _attend(bq, bk, bv, start, block, torch.bfloat16, True, monkeypatch).float()
    assert split.dtype == torch.float32 and (split - exact).abs().max() <= 2 * (sdpa - exact).abs().max() + 1e-3


def test_cache_growth_doubles_up_to_the_request_size():
    """Capacity doubles as positions arrive, but not past max_capacity (the request's prompt + max_tokens);
    a write past it still gets exactly the room it needs, and the stored K/V survive every move."""
    cache = KVCache([(2, 4)], torch.float32, "cpu", capacity=64, max_capacity=100)
    cache.k[0][:, :64] = 1.0
    cache.length = 64
    cache.reserve(70)
    assert cache.capacity == 100                  # not 128
    assert torch.equal(cache.k[0][:, :64], torch.ones(2, 64, 4))
    cache.reserve(130)
    assert cache.capacity == 130                  # need wins over the cap
    free = KVCache([(2, 4)], torch.float32, "cpu", capacity=64)
    free.reserve(70)
    assert free.capacity == 128


@pytest.mark.parametrize("start,length,group", [(0, 300, 1), (0, 1100, 8), (700, 520, 1), (700, 520, 8),
                                                (2000, 16, 8), (64, 9, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_prompt_chunk_without_a_mask_equals_the_masked_call(start, length, group, dtype, monkeypatch):
    """A causal-context prompt chunk (block ids = positions, the last `group` rows one block: the active block)
    runs on the kernels' causal rule and one unmasked call, no mask built."""
    g = torch.Generator().manual_seed(start + length)
    h, hk, d = 8, 4, 32
    q = torch.randn(length, h, d, generator=g).to(dtype)
    k = (torch.randn(start + length, hk, d, generator=g) * 2).to(dtype)
    v = torch.randn(start + length, hk, d, generator=g).to(dtype)
    cache = KVCache([(hk, d)], dtype, "cpu", capacity=start + length)
    cache.k[0][:, :start] = k[:start].transpose(0, 1)
    cache.v[0][:, :start] = v[:start].transpose(0, 1)
    cache.length = start
    ids = torch.arange(start, start + length).clamp(max=start + length - group)
    seg = Segment(start=start, length=length, write=length, cache=cache, block_ids=ids)
    batch = AttentionBatch([seg]).prepare()
    assert seg.causal_rows == (length if group == 1 else length - group)
    monkeypatch.setattr(attention, "_attend_split", lambda *a: pytest.fail("took the masked split path"))
    out = ragged_attention(q, k[start:], v[start:], batch, 0)
    visible = torch.cat([torch.ones(length, start, dtype=torch.bool), ids[None, :] <= ids[:, None]], dim=1)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().repeat_interleave(2, dim=1).transpose(0, 1),
        v.float().repeat_interleave(2, dim=1).transpose(0, 1), attn_mask=visible).transpose(0, 1)
    assert out.shape == ref.shape and out.dtype == dtype
    assert (out.float() - ref).abs().max().item() < (1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("ids,rows", [([0, 1, 2, 3, 4, 4], 4), ([5, 6, 7], 3), ([0, 0, 1, 1], 0), ([0, 2, 3], 0),
                                      ([0, 1, 1, 2, 2], 0)])
def test_causal_rows_of_block_ids(ids, rows):
    b = torch.tensor(ids)
    s = Segment(start=0, length=len(ids), block_ids=b)
    s.prepare()
    assert s.causal_rows == rows and s.masked
    # the mask rows a masked path asks for, built from the block ids on demand
    full = b[None, :] <= b[:, None]
    assert torch.equal(s.own_mask(0, len(ids)), full) and torch.equal(s.own_mask(1, 3, 2), full[1:3, :2])
    assert torch.equal(s.mask_rows(0, len(ids)), full)


def test_one_block_is_unmasked_and_an_explicit_mask_is_used_as_given():
    s = Segment(start=4, length=3, suffix=2, block_ids=torch.tensor([7, 7, 7]))
    s.cache = KVCache([(1, 2)], torch.float32, "cpu", capacity=16)
    s.cache.length = 4
    s.prepare()
    assert not s.masked and s.causal_rows == 0 and s.own_mask(0, 3) is None and s.mask_rows(0, 3) is None
    attend = torch.tensor([[True, False, False], [True, True, False], [False, True, True]])
    s = Segment(start=0, length=3, block_ids=torch.arange(3), attend=attend)
    s.prepare()
    assert s.masked and s.causal_rows == 0 and torch.equal(s.own_mask(0, 3), attend)


def _causal_context_model(tmp_path, max_pos: int = 4096):
    from unmask.models.loader import load_model
    from unmask.train.checkpoint import export_model
    from unmask.train.model_init import fresh_model, init_weights, new_unmask_config

    cfg = new_unmask_config(96, 32, 2, 4, 2, 8, 64, max_pos, 4, mask_id=3, eos_ids=[2], tie_embeddings=True)
    cfg["causal_context"] = cfg["shift_logits"] = True
    tm = fresh_model(cfg, {"eos_token_id": [2]}, seed=0)
    init_weights(tm.model, 0, std=0.2)
    return load_model(export_model(tm, tmp_path / "m", None))[0]


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operator returns while active (a [T, T] mask would be T * T)."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_causal_prompt_chunks_build_no_square_mask_and_match_the_causal_forward(tmp_path):
    """A causal-context prompt prefilled in three chunks: every chunk's hidden states equal the dense causal forward
    (the chunks after the first read the cached prefix), and no operator returns a tensor anywhere near a
    [chunk, chunk] mask: the largest is an activation, linear in the chunk (the MLP's [chunk, 64], or on the CPU the
    fused gate/up product's [chunk, 2 x 64])."""
    from unmask.models.attention import commit_cache_lengths
    from unmask.models.transformer import CAUSAL

    model = _causal_context_model(tmp_path)
    chunk, n = 1024, 3072
    ids = torch.randint(4, 96, (n,), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(capacity=n)
    hidden, largest = [], []
    with torch.no_grad():
        for lo in range(0, n, chunk):
            pos = torch.arange(lo, lo + chunk)
            with _LargestTensor() as probe:
                batch = AttentionBatch([Segment(start=lo, length=chunk, write=chunk, cache=cache, block_ids=pos)])
                hidden.append(model(ids[lo:lo + chunk], pos, batch.prepare()))
            commit_cache_lengths(batch)
            largest.append(probe.largest)
            assert batch.segments[0].causal_rows == chunk
        dense = model.forward_dense(ids[None], torch.arange(n)[None], CAUSAL)[0]
    assert max(largest) <= 2 * 64 * chunk < chunk * chunk // 4   # the fused gate/up output [chunk, 2 x 64] on the CPU
    assert (torch.cat(hidden) - dense).abs().max().item() < 1e-5
