"""Memory (issue 34, item 4): a request whose KV cache cannot fit is refused up front with the number of tokens
that would (engine, CLI, HTTP 400), counting the copy attention reads a cache of another dtype back into, and a
KV cache kept in bfloat16 (--kv-cache-dtype) attends in the compute dtype with logits close to a float32 cache's.

The memory reading (unmask.engine.memory.available_bytes) is an input of the check: tests set it."""
import math

import httpx
import pytest
import torch
from typer.testing import CliRunner

from store_server import start_app
from unmask.cli import app
from unmask.engine import memory
from unmask.engine.engine import Engine
from unmask.engine.params import GenerationParams
from unmask.errors import ContextLengthError, MemoryLimitError
from unmask.models.attention import AttentionBatch, Segment, commit_cache_lengths
from unmask.models.loader import load_model


def free_memory(monkeypatch, tokens: int, bytes_per_token: int) -> int:
    """Make the memory free now what leaves room for exactly `tokens` tokens of cache; returns that count."""
    available = math.ceil((tokens * bytes_per_token + memory.RESERVED_BYTES) / memory.USABLE_SHARE) + 2
    monkeypatch.setattr(memory, "available_bytes", lambda device: available)
    return memory.budget(bytes_per_token, "cpu").tokens


def test_bytes_per_token_from_the_config(family_dirs):
    model, spec = load_model(family_dirs["sdar"])
    a = spec.arch
    f32 = Engine(model, spec)
    assert f32.kv_bytes_per_token == f32.memory_per_token == a.num_layers * a.num_kv_heads * a.head_dim * 2 * 4
    bf16 = Engine(model, spec, kv_cache_dtype=torch.bfloat16)
    assert bf16.kv_bytes_per_token == a.num_layers * a.num_kv_heads * a.head_dim * 2 * 2
    # under float32 weights one layer's K/V is read back as a float32 copy while it attends: counted too
    assert bf16.memory_per_token == bf16.kv_bytes_per_token + a.num_kv_heads * a.head_dim * 2 * 4


def test_a_request_that_cannot_fit_is_refused_with_the_tokens_that_would(family_dirs, monkeypatch):
    model, spec = load_model(family_dirs["sdar"])
    engine = Engine(model, spec)
    fit = free_memory(monkeypatch, 40, engine.kv_bytes_per_token)
    assert fit == 40
    with pytest.raises(MemoryLimitError, match=r"at most 40 tokens \(prompt plus max_tokens\) would fit") as e:
        engine.add_request(list(range(20, 50)), GenerationParams(max_tokens=16, block_size=4))  # 46 tokens
    assert isinstance(e.value, ContextLengthError) and e.value.param == "max_tokens"
    assert "prompt (30 tokens) plus max_tokens (16)" in str(e.value)
    assert not engine.has_unfinished()  # refused before anything was queued
    seq = engine.add_request(list(range(20, 44)), GenerationParams(max_tokens=16, block_size=4))  # 40: fits
    engine.run_to_completion()
    assert seq.num_generated == 16


def test_a_bfloat16_cache_holds_more_tokens(tmp_path, monkeypatch):
    from tiny_checkpoints import make_sdar

    model, spec = load_model(make_sdar(tmp_path / "sdar4", num_hidden_layers=4))
    f32, bf16 = Engine(model, spec), Engine(model, spec, kv_cache_dtype=torch.bfloat16)
    free_memory(monkeypatch, 40, f32.memory_per_token)
    # 4 layers x 2 kv heads x head dim 8: 512 bytes a token in float32, 256 + a 128-byte read copy in bfloat16
    assert (f32.memory_per_token, bf16.memory_per_token) == (512, 384)
    params = GenerationParams(max_tokens=16, block_size=4)
    with pytest.raises(MemoryLimitError, match="at most 40 tokens"):
        f32.add_request(list(range(20, 20 + 53 - 16)), params)
    with pytest.raises(MemoryLimitError, match=r"bfloat16 KV cache \(and 0 MiB to read a layer of it back\).*"
                                               "at most 53 tokens"):
        bf16.add_request(list(range(20, 20 + 54 - 16)), params)
    seq = bf16.add_request(list(range(20, 20 + 53 - 16)), params)  # 53 = 40 x 512 // 384
    assert seq.cache.k[0].dtype == torch.bfloat16


def test_bidirectional_families_without_a_cache_are_not_checked(family_dirs, monkeypatch):
    model, spec = load_model(family_dirs["llada"])
    engine = Engine(model, spec)
    monkeypatch.setattr(memory, "available_bytes", lambda device: 0)
    engine.add_request(list(range(20, 30)), GenerationParams(max_tokens=4, steps=2, block_size=4))
    with pytest.raises(MemoryLimitError, match="at most 0 tokens"):  # the prefix cache keeps K/V
        engine.add_request(list(range(20, 30)), GenerationParams(max_tokens=4, steps=2, block_size=4, cache="prefix"))


def _block_logits(model, prompt: list[int], block: list[int], dtype) -> torch.Tensor:
    """The engine's two forwards: the prompt written into a cache of `dtype`, then a masked block read over it."""
    n, b = len(prompt), len(block)
    cache = model.new_cache(capacity=n + b, dtype=dtype)
    batch = AttentionBatch([Segment(0, n, write=n, cache=cache, block_ids=torch.arange(n) // b)]).prepare()
    with torch.no_grad():
        model(torch.tensor(prompt), torch.arange(n), batch)
        commit_cache_lengths(batch)
        batch = AttentionBatch([Segment(n, b, cache=cache, block_ids=torch.zeros(b, dtype=torch.long))]).prepare()
        hidden = model(torch.tensor(block), torch.arange(n, n + b), batch)
    assert cache.k[0].dtype == dtype
    return model.logits(hidden)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])  # int8: unmask.models.kv_int8
@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_narrow_cache_logits_close_to_float32(family, dtype, family_dirs):
    model, spec = load_model(family_dirs[family])  # float32 weights (tests/conftest.py)
    prompt, block = list(range(20, 52)), [spec.mask_id] * 4
    exact = _block_logits(model, prompt, block, torch.float32)
    rounded = _block_logits(model, prompt, block, dtype)
    assert rounded.dtype == torch.float32
    err = (rounded - exact).abs().max().item()
    assert 0 < err < 2e-2 * exact.abs().max().item()  # bf16: 8 bits of mantissa, int8: 1/254 of each vector's max
    assert torch.equal(rounded.argmax(-1), exact.argmax(-1))


def test_generate_refuses_in_one_line(family_dirs, monkeypatch):
    model, spec = load_model(family_dirs["sdar"])
    free_memory(monkeypatch, 10, Engine(model, spec, kv_cache_dtype=torch.bfloat16).memory_per_token)
    r = CliRunner().invoke(app, ["generate", "--model", str(family_dirs["sdar"]), "--max-tokens", "16",
                                 "--block-size", "4", "--kv-cache-dtype", "bfloat16", "hello world"])
    assert r.exit_code != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "at most 10 tokens" in lines[0] and "bfloat16 KV cache" in lines[0], r.stderr


def test_server_answers_400_with_the_tokens_that_fit(monkeypatch):
    live = start_app(None, kv_cache_dtype="bfloat16", max_num_seqs=2)
    try:
        live.wait_model()
        engine = live.app.state.serving.llm.engine
        assert engine.kv_cache_dtype == torch.bfloat16
        free_memory(monkeypatch, 100, engine.memory_per_token)
        r = httpx.post(f"{live.url}/v1/completions", json={"prompt": "def add(a, b):" * 20, "max_tokens": 64},
                       timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded", err
        assert "at most 100 tokens" in err["message"] and err["type"] == "invalid_request_error", err
        ok = httpx.post(f"{live.url}/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 8}, timeout=60)
        assert ok.status_code == 200, ok.text
    finally:
        live.stop()


@pytest.mark.parametrize("family", ["sdar", "fast_dllm_v2"])  # same-position and shifted logits
def test_cached_loss_equals_the_training_forward_and_narrow_caches_move_it_little(family, family_dirs):
    from pathlib import Path

    from unmask.engine.llm import LLM
    from unmask.evaluation import masked_token_loss
    from unmask.evaluation_cache import cached_masked_token_loss
    from unmask.train.corpus import CorpusFile

    src = Path(__file__).resolve().parents[1] / "src" / "unmask"
    docs = [CorpusFile("stdlib", p.name, p.read_text()) for p in sorted(src.glob("*.py"))[:4]]
    llm = LLM(family_dirs[family])
    dense = masked_token_loss(llm, docs, 4, seq_len=64, max_rows=8)
    exact = cached_masked_token_loss(llm, docs, 4, None, seq_len=64, max_rows=8)
    rounded = cached_masked_token_loss(llm, docs, 4, torch.bfloat16, seq_len=64, max_rows=8)
    assert exact == pytest.approx(dense, rel=1e-5)
    assert rounded != exact and rounded == pytest.approx(exact, rel=1e-2)
    quantized = cached_masked_token_loss(llm, docs, 4, torch.int8, seq_len=64, max_rows=8)
    assert quantized != exact and quantized == pytest.approx(exact, rel=1e-2)
