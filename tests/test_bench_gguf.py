"""The AR twin's GGUF export (bench/benchlib/gguf_export.py) read back: metadata, vocabulary, merges and
every tensor equal the transformers checkpoint; with llama-cpp-python installed, llama.cpp's logits equal
transformers' (the same network, so the bench's llama.cpp row measures the twin)."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from benchlib.gguf_export import export  # noqa: E402


@pytest.fixture(scope="module")
def twin_dir(tmp_path_factory) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from unmask.defaults import default_model_path

    out = tmp_path_factory.mktemp("twin")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms, so a misplaced norm tensor would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape))
    model.save_pretrained(out)
    src = default_model_path()
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / f).is_file():
            shutil.copy(src / f, out / f)
    return out


def test_gguf_round_trip(twin_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    path = export(twin_dir, tmp_path / "twin.gguf")
    r = gguf.GGUFReader(path)

    def field(key):
        f = r.fields[key]
        return f.contents()

    assert field("general.architecture") == "qwen3"
    assert (field("qwen3.block_count"), field("qwen3.embedding_length"), field("qwen3.attention.head_count"),
            field("qwen3.attention.head_count_kv"), field("qwen3.attention.key_length")) == (2, 64, 4, 2, 16)
    tok = AutoTokenizer.from_pretrained(str(twin_dir))
    tokens = field("tokenizer.ggml.tokens")
    vocab = tok.get_vocab()
    assert len(tokens) == 8192 and all(tokens[i] == t for t, i in vocab.items())
    merges = json.loads((twin_dir / "tokenizer.json").read_text())["model"]["merges"]
    assert len(field("tokenizer.ggml.merges")) == len(merges)
    assert field("tokenizer.ggml.eos_token_id") == tok.eos_token_id

    state = load_file(str(twin_dir / "model.safetensors"))
    got = {t.name: t for t in r.tensors}
    assert "output.weight" not in got  # tied: llama.cpp reads the output from token_embd
    assert len(got) == 1 + 2 * 11 + 1  # embeddings, 11 tensors per layer, final norm
    pairs = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "model.layers.1.self_attn.k_norm.weight": "blk.1.attn_k_norm.weight",
             "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
             "model.layers.1.post_attention_layernorm.weight": "blk.1.ffn_norm.weight"}
    for hf_name, g_name in pairs.items():
        want = state[hf_name].numpy()
        have = np.asarray(got[g_name].data).reshape(want.shape)
        np.testing.assert_array_equal(have, want)


def test_llama_cpp_logits_equal_transformers(twin_dir, tmp_path):
    pytest.importorskip("llama_cpp")
    from benchlib.twin import HFTwin, LlamaCppTwin

    path = export(twin_dir, tmp_path / "twin.gguf")
    hf = HFTwin(twin_dir)
    lc = LlamaCppTwin(path, hf, threads=1)
    assert lc.logit_gap([1, 300, 301, 302, 5000, 17]) < 1e-3
    prompt = [1, 40, 41, 42, 43]
    mine, ref = lc.run(prompt, 12, stop_newline=False), hf.run(prompt, 12, stop_newline=False)
    assert (mine.text, mine.tokens) == (ref.text, ref.tokens)
