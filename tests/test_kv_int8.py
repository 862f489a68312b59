"""The int8 KV cache (issue 34, item 4; unmask.models.kv_int8): exact storage shapes and bytes, round-trip error
within half a quantisation step, the engine's memory check counting it, the prefix cache carrying the scales, and
one-line refusals where it is not supported (logits against a float32 cache: test_kv_memory)."""
import pytest
import torch
from typer.testing import CliRunner

from test_kv_memory import free_memory
from unmask.cli import app
from unmask.engine.engine import Engine
from unmask.engine.params import GenerationParams
from unmask.errors import InvalidRequestError, MemoryLimitError
from unmask.models.kv_int8 import SCALE_BYTES, Int8KVCache, dequantize, quantize
from unmask.models.loader import load_model


def test_quantize_packs_values_and_a_float32_scale_per_head_and_position():
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0))
    packed = quantize(x)
    assert packed.shape == (3, 5, 16 + SCALE_BYTES) and packed.dtype == torch.int8
    scale = packed[..., 16:].contiguous().view(torch.float32)
    assert scale.shape == (3, 5, 1)
    assert torch.allclose(scale, x.abs().amax(-1, keepdim=True) / 127)
    assert packed[..., :16].abs().max().item() == 127  # each vector's largest value lands on +-127
    back = dequantize(packed, torch.float32)
    assert back.shape == x.shape and back.dtype == torch.float32
    assert ((back - x).abs() <= scale / 2 + 1e-7).all()  # round to nearest: half a step at most
    assert dequantize(packed, torch.bfloat16).dtype == torch.bfloat16


def test_quantize_is_exact_on_multiples_of_the_scale_and_zero_stays_zero():
    x = torch.tensor([[[-127.0, 0.0, 5.0, 127.0]]]) * 0.25
    assert torch.equal(dequantize(quantize(x), torch.float32), x)
    zero = torch.zeros(2, 3, 8)
    assert torch.equal(dequantize(quantize(zero), torch.float32), zero)


def test_int8_cache_shapes_and_bytes(family_dirs):
    model, spec = load_model(family_dirs["sdar"])
    a = spec.arch
    cache = model.new_cache(capacity=40, dtype=torch.int8)
    assert isinstance(cache, Int8KVCache)
    assert cache.capacity == 64 and len(cache.k) == a.num_layers  # grown to the 64-position minimum
    assert cache.k[0].shape == (a.num_kv_heads, 64, a.head_dim + SCALE_BYTES) and cache.k[0].dtype == torch.int8
    per_token = a.num_layers * a.num_kv_heads * (a.head_dim + SCALE_BYTES) * 2
    assert cache.bytes_per_token() == per_token and cache.nbytes() == 64 * per_token
    assert Engine(model, spec, kv_cache_dtype=torch.int8).kv_bytes_per_token == per_token
    # writes past capacity grow it and keep what was written (scales included)
    k = torch.randn(a.num_kv_heads, 64, a.head_dim)
    cache.write(0, 0, k, -k)
    cache.length = 64
    cache.reserve(100)
    assert cache.capacity >= 100
    rk, rv = cache.read(0, 64, torch.float32)
    assert rk.shape == k.shape and torch.allclose(rk, k, atol=k.abs().max().item() / 254 + 1e-6)
    assert torch.equal(rv, -rk)


def test_engine_memory_check_counts_the_int8_cache(family_dirs, monkeypatch):
    model, spec = load_model(family_dirs["sdar"])
    f32, int8 = Engine(model, spec), Engine(model, spec, kv_cache_dtype=torch.int8)
    free_memory(monkeypatch, 40, f32.memory_per_token)
    a = spec.arch  # head dim 8: 12 bytes per head and position against 32, plus a float32 read copy of one layer
    assert int8.memory_per_token == a.num_layers * a.num_kv_heads * 12 * 2 + a.num_kv_heads * a.head_dim * 2 * 4
    fit = 40 * f32.memory_per_token // int8.memory_per_token
    params = GenerationParams(max_tokens=16, block_size=4)
    with pytest.raises(MemoryLimitError, match=f"int8 KV cache.*at most {fit} tokens"):
        int8.add_request(list(range(20, 20 + fit - 16 + 1)), params)
    seq = int8.add_request(list(range(20, 20 + fit - 16)), params)
    assert seq.cache.k[0].dtype == torch.int8
    int8.run_to_completion()
    assert seq.num_generated == 16


def test_prefix_cache_blocks_carry_the_scales(family_dirs):
    """A prompt decoded twice: the second run loads its prompt blocks from the prefix cache (int8 rows with their
    scales) and must answer exactly as the first, which computed them."""
    model, spec = load_model(family_dirs["sdar"])
    engine = Engine(model, spec, kv_cache_dtype=torch.int8)
    prompt = list(range(20, 60))
    params = GenerationParams(max_tokens=8, block_size=4, temperature=0.0)
    first = engine.add_request(prompt, params)
    engine.run_to_completion()
    hits = engine.prefix_cache.hits
    second = engine.add_request(prompt, params)
    engine.run_to_completion()
    assert engine.prefix_cache.hits > hits and second.cached > 0
    assert second.output_ids == first.output_ids


def test_int8_refused_where_unsupported(family_dirs, tmp_path):
    pytest.importorskip("transformers")
    from test_diffusion_gemma import make_checkpoint

    model, spec = load_model(make_checkpoint(tmp_path / "dgemma"))
    with pytest.raises(InvalidRequestError, match="int8 KV cache is not supported for the diffusion_gemma"):
        Engine(model, spec, kv_cache_dtype=torch.int8)
    model, spec = load_model(family_dirs["sdar"])
    with pytest.raises(InvalidRequestError, match="not supported with the static step"):
        Engine(model, spec, kv_cache_dtype=torch.int8, static_step=True, kv_pool_tokens=256)


def test_generate_with_an_int8_cache_and_a_bad_name(family_dirs):
    args = ["generate", "--model", str(family_dirs["sdar"]), "--max-tokens", "8", "--block-size", "4"]
    ok = CliRunner().invoke(app, args + ["--kv-cache-dtype", "int8", "hello world"])
    assert ok.exit_code == 0, ok.output
    bad = CliRunner().invoke(app, args + ["--kv-cache-dtype", "int4", "hello world"])
    lines = bad.stderr.strip().splitlines()
    assert bad.exit_code != 0 and len(lines) == 1 and "int8" in lines[0] and "'int4'" in lines[0], bad.stderr
