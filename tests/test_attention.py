"""Ragged attention's long-prefix path (prefix and own keys attended apart, merged by log-sum-exp) against
the single masked SDPA call it replaces."""
import pytest
import torch

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
