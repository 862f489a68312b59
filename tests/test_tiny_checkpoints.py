"""Fast checks of the tiny random checkpoints (tests/tiny_checkpoints.py) and of the naive reference
forward (tests/reference_forward.py). Expected names, shapes and ids are written out literally from
docs/families.md so that a drift in either helper is caught."""
from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import reference_forward as rf
import tiny_checkpoints as tc

FAMILY_NAMES = list(tc.FAMILIES)


@pytest.fixture(scope="module")
def ckpt(family_dirs: dict[str, Path]) -> dict[str, Path]:
    """family -> directory of the default tiny checkpoint (seed 0, float32, single file); the
    session-wide copy from conftest.py. Tests must not write into these directories."""
    return family_dirs


def _shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in rf.load_weights(model_dir).items()}


def _ids(n: int, seed: int, high: int = 700) -> torch.Tensor:
    return torch.randint(0, high, (1, n), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------

EXPECTED_CONFIG = {  # families.md 0, 1.1, 2.1, 3.1, 4.1, 5.1
    "llada": {"model_type": "llada", "architectures": ["LLaDAModelLM"], "vocab_size": 126464,
              "embedding_size": 126464, "mask_token_id": 126336, "eos_token_id": 126081, "pad_token_id": 126081,
              "n_heads": 4, "n_kv_heads": 4, "d_model": 32, "n_layers": 2, "mlp_hidden_size": 64,
              "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "weight_tying": False, "block_type": "llama"},
    "dream": {"model_type": "Dream", "architectures": ["DreamModel"], "vocab_size": 152064, "mask_token_id": 151666,
              "eos_token_id": 151643, "pad_token_id": 151643, "num_key_value_heads": 2, "rope_theta": 1000000.0,
              "tie_word_embeddings": False},
    "sdar": {"model_type": "sdar", "architectures": ["SDARForCausalLM"], "vocab_size": 151936, "mask_token_id": 151669,
             "block_size": 4, "head_dim": 8, "eos_token_id": 151643, "attention_bias": False, "sliding_window": None,
             "max_window_layers": 2},
    "fast_dllm_v2": {"model_type": "Fast_dLLM_Qwen", "architectures": ["Fast_dLLM_QwenForCausalLM"],
                     "vocab_size": 152064, "bd_size": 32, "eos_token_id": 151645,
                     "layer_types": ["full_attention", "full_attention"]},
    "llada2": {"model_type": "llada2_moe", "architectures": ["LLaDA2MoeModelLM"], "vocab_size": 157184,
               "head_dim": 16, "partial_rotary_factor": 0.5, "num_experts": 8, "num_experts_per_tok": 2,
               "n_group": 4, "topk_group": 2, "num_shared_experts": 1, "first_k_dense_replace": 1,
               "moe_intermediate_size": 16, "num_hidden_layers": 3, "use_bias": False, "use_qk_norm": True,
               "routed_scaling_factor": 2.5, "rope_theta": 600000.0, "eos_token_id": 156892, "pad_token_id": 156892},
}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_config_has_real_keys(ckpt, family):
    cfg = json.loads((ckpt[family] / "config.json").read_text())
    for key, value in EXPECTED_CONFIG[family].items():
        assert cfg[key] == value, key
    assert cfg["torch_dtype"] == "float32"
    assert "AutoConfig" in cfg["auto_map"]
    assert rf.family_of(cfg) == family


def test_generation_configs(ckpt):
    g = json.loads((ckpt["llada"] / "generation_config.json").read_text())
    assert (g["bos_token_id"], g["eos_token_id"]) == (126080, 126081)
    g = json.loads((ckpt["sdar"] / "generation_config.json").read_text())
    assert g["eos_token_id"] == [151645, 151643] and g["pad_token_id"] == 151643 and g["top_k"] == 20


# ---------------------------------------------------------------------------------------------
# safetensors names and shapes (families.md 1.2, 2.2, 3.2, 4.2, 5.2 with tiny sizes)
# ---------------------------------------------------------------------------------------------

def _llada_expected() -> dict[str, tuple[int, ...]]:
    e = {"model.transformer.wte.weight": (126464, 32), "model.transformer.ln_f.weight": (32,),
         "model.transformer.ff_out.weight": (126464, 32)}
    for i in range(2):
        p = f"model.transformer.blocks.{i}."
        e.update({p + "attn_norm.weight": (32,), p + "q_proj.weight": (32, 32), p + "k_proj.weight": (32, 32),
                  p + "v_proj.weight": (32, 32), p + "attn_out.weight": (32, 32), p + "ff_norm.weight": (32,),
                  p + "ff_proj.weight": (64, 32), p + "up_proj.weight": (64, 32), p + "ff_out.weight": (32, 64)})
    return e


def _qwen_expected(vocab: int, bias: bool, qk_norm: bool) -> dict[str, tuple[int, ...]]:
    e = {"model.embed_tokens.weight": (vocab, 32), "model.norm.weight": (32,), "lm_head.weight": (vocab, 32)}
    for i in range(2):
        p = f"model.layers.{i}."
        e.update({p + "self_attn.q_proj.weight": (32, 32), p + "self_attn.k_proj.weight": (16, 32),
                  p + "self_attn.v_proj.weight": (16, 32), p + "self_attn.o_proj.weight": (32, 32),
                  p + "mlp.gate_proj.weight": (64, 32), p + "mlp.up_proj.weight": (64, 32),
                  p + "mlp.down_proj.weight": (32, 64), p + "input_layernorm.weight": (32,),
                  p + "post_attention_layernorm.weight": (32,)})
        if bias:
            e.update({p + "self_attn.q_proj.bias": (32,), p + "self_attn.k_proj.bias": (16,),
                      p + "self_attn.v_proj.bias": (16,)})
        if qk_norm:
            e.update({p + "self_attn.q_norm.weight": (8,), p + "self_attn.k_norm.weight": (8,)})
    return e


def _llada2_expected() -> dict[str, tuple[int, ...]]:
    e = {"model.word_embeddings.weight": (157184, 32), "model.norm.weight": (32,), "lm_head.weight": (157184, 32)}
    for i in range(3):
        p = f"model.layers.{i}."
        e.update({p + "input_layernorm.weight": (32,), p + "post_attention_layernorm.weight": (32,),
                  p + "attention.query_key_value.weight": ((4 + 2 * 2) * 16, 32),
                  p + "attention.query_layernorm.weight": (16,), p + "attention.key_layernorm.weight": (16,),
                  p + "attention.dense.weight": (32, 64)})
        if i == 0:
            e.update({p + "mlp.gate_proj.weight": (64, 32), p + "mlp.up_proj.weight": (64, 32),
                      p + "mlp.down_proj.weight": (32, 64)})
            continue
        e.update({p + "mlp.gate.weight": (8, 32), p + "mlp.gate.expert_bias": (8,),
                  p + "mlp.shared_experts.gate_proj.weight": (16, 32), p + "mlp.shared_experts.up_proj.weight": (16, 32),
                  p + "mlp.shared_experts.down_proj.weight": (32, 16)})
        for x in range(8):
            e.update({p + f"mlp.experts.{x}.gate_proj.weight": (16, 32), p + f"mlp.experts.{x}.up_proj.weight": (16, 32),
                      p + f"mlp.experts.{x}.down_proj.weight": (32, 16)})
    return e


EXPECTED_SHAPES = {
    "llada": _llada_expected(),
    "dream": _qwen_expected(152064, bias=True, qk_norm=False),
    "sdar": _qwen_expected(151936, bias=False, qk_norm=True),
    "fast_dllm_v2": _qwen_expected(152064, bias=True, qk_norm=False),
    "llada2": _llada2_expected(),
}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_weight_names_and_shapes_exact(ckpt, family):
    assert _shapes(ckpt[family]) == EXPECTED_SHAPES[family]
    with safe_open(str(ckpt[family] / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert all(f.get_tensor(k).dtype == torch.float32 for k in f.keys())


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_init_statistics(ckpt, family):
    """Norm weights are 1 + noise (exercised), matrices are small, nothing is constant."""
    w = rf.load_weights(ckpt[family])
    norms = [v for k, v in w.items() if v.dim() == 1 and ("norm" in k or "ln_f" in k)]
    assert norms and all(abs(v.mean().item() - 1) < 0.15 and v.std().item() > 0.02 for v in norms)
    emb = next(v for k, v in w.items() if "embed" in k or "wte" in k)
    assert abs(emb.std().item() - tc.INIT_STD) < 0.002


def test_llada2_fused_qkv_row_order(ckpt):
    """Rows [Q(4 heads) | K(2) | V(2)] of 16 each: Q and K rows were drawn with QK_STD, V with INIT_STD."""
    qkv = rf.load_weights(ckpt["llada2"])["model.layers.1.attention.query_key_value.weight"]
    q, k, v = qkv.split([64, 32, 32])
    assert q.std() > 0.1 and k.std() > 0.1 and v.std() < 0.03


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_seed_and_dtype_overrides(tmp_path, family):
    make = tc.FAMILIES[family]
    a = make(tmp_path / "a", seed=0, dtype="bfloat16")
    b = make(tmp_path / "b", seed=1, dtype=torch.bfloat16)
    assert json.loads((a / "config.json").read_text())["torch_dtype"] == "bfloat16"
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(t.dtype == torch.bfloat16 for t in wa.values())
    assert all(not torch.equal(wa[k], wb[k]) for k in wa)


def test_config_overrides_and_drop(tmp_path):
    d = tc.make_sdar(tmp_path / "s", block_size=tc.DROP, mask_token_id=tc.DROP, num_hidden_layers=3)
    cfg = json.loads((d / "config.json").read_text())
    assert "block_size" not in cfg and "mask_token_id" not in cfg and cfg["max_window_layers"] == 3
    assert "model.layers.2.self_attn.q_norm.weight" in _shapes(d)
    # head_dim != hidden / heads (as in SDAR-4B): o_proj is [hidden, heads * head_dim]
    d = tc.make_sdar(tmp_path / "s16", head_dim=16)
    s = _shapes(d)
    assert s["model.layers.0.self_attn.q_proj.weight"] == (64, 32) and s["model.layers.0.self_attn.o_proj.weight"] == (32, 64)
    assert rf.reference_logits(d, _ids(6, 0), "block_causal:4").shape == (1, 6, 151936)


def test_tied_embeddings_layout(tmp_path):
    """Fast-dLLM v2 1.5B-style: tie_word_embeddings true -> no lm_head; reference uses the embedding."""
    d = tc.make_fast_dllm_v2(tmp_path / "tied", tie_word_embeddings=True)
    w = rf.load_weights(d)
    assert "lm_head.weight" not in w
    ids = _ids(5, 3)
    logits = rf.reference_logits(d, ids, "causal")
    assert logits.shape == (1, 5, 152064)


def test_llada2_dense_bias_when_use_bias(tmp_path):
    d = tc.make_llada2(tmp_path / "b", use_bias=True)
    assert _shapes(d)["model.layers.0.attention.dense.bias"] == (32,)
    out_bias = rf.reference_logits(d, _ids(4, 0), "bidirectional")
    assert torch.isfinite(out_bias).all()


# ---------------------------------------------------------------------------------------------
# sharded layout
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_sharded_index_consistent(ckpt, tmp_path, family):
    d = tc.FAMILIES[family](tmp_path / family, sharded=True)
    assert not (d / "model.safetensors").exists()
    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    total = 0
    for f in files:
        with safe_open(str(d / f), "pt") as h:
            keys = set(h.keys())
            assert keys == {k for k, v in index["weight_map"].items() if v == f}
            total += sum(h.get_tensor(k).numel() * h.get_tensor(k).element_size() for k in keys)
    assert index["metadata"]["total_size"] == total
    single, sharded = rf.load_weights(ckpt[family]), rf.load_weights(d)
    assert single.keys() == sharded.keys() == index["weight_map"].keys()
    assert all(torch.equal(single[k], sharded[k]) for k in single)


# ---------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------

def _tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    # trust_remote_code=False: config.json carries the real auto_map, which would otherwise prompt.
    return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False, local_files_only=True)


SPECIALS = {  # families.md 1.4, 2.4, 3.4, 4.1, 5.4
    "llada": {"<|startoftext|>": 126080, "<|endoftext|>": 126081, "<|mdm_mask|>": 126336,
              "<|start_header_id|>": 126346, "<|end_header_id|>": 126347, "<|eot_id|>": 126348},
    "dream": {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|mask|>": 151666},
    "sdar": {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<think>": 151667,
             "</think>": 151668, "<|MASK|>": 151669},
    "fast_dllm_v2": {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "|<MASK>|": 151665},
    "llada2": {"<|endoftext|>": 156892, "<|mask|>": 156895},
}
EOS = {"llada": 126081, "dream": 151643, "sdar": 151643, "fast_dllm_v2": 151645, "llada2": 156892}
TOKENIZER_MASK = {"llada": None, "dream": "<|mask|>", "sdar": "<|MASK|>", "fast_dllm_v2": None, "llada2": None}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_tokenizer_ids(ckpt, family):
    tok = _tokenizer(ckpt[family])
    mask_str, mask_id = tc.MASK_TOKENS[family]
    assert tok.convert_tokens_to_ids(mask_str) == mask_id
    for s, i in SPECIALS[family].items():
        assert tok.convert_tokens_to_ids(s) == i and tok.convert_ids_to_tokens(i) == s
    assert tok.eos_token_id == EOS[family]
    assert tok.mask_token == TOKENIZER_MASK[family]
    text = "def f(x):\n    return x + 1  # héllo wörld"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and max(ids) < 1000
    # specials inside text map to their single real id
    ids = tok(f"a{mask_str}{mask_str}b", add_special_tokens=False)["input_ids"]
    assert ids.count(mask_id) == 2 and len(ids) == 4


def test_fast_dllm_v2_mask_is_additional_special(ckpt):
    tok = _tokenizer(ckpt["fast_dllm_v2"])
    assert "|<MASK>|" in tok.all_special_tokens and tok.pad_token_id == 151643


CHAT = [{"role": "user", "content": "Hi"}]
EXPECTED_CHAT = {
    "llada": "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
             "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "dream": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
             "<|im_start|>assistant\n",
    "sdar": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "fast_dllm_v2": "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "llada2": "<role>HUMAN</role>Hi<|role_end|><role>ASSISTANT</role>",
}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_chat_template_renders(ckpt, family):
    tok = _tokenizer(ckpt[family])
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text == EXPECTED_CHAT[family]
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text


def test_chat_template_details(ckpt):
    llada = _tokenizer(ckpt["llada"])
    # LLaDA strips content and always appends the assistant header, even without add_generation_prompt
    two = [{"role": "system", "content": " S "}, {"role": "user", "content": "U\n"}]
    assert llada.apply_chat_template(two, tokenize=False) == (
        "<|startoftext|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    dream = _tokenizer(ckpt["dream"])
    sys_first = [{"role": "system", "content": "X"}, *CHAT]
    assert dream.apply_chat_template(sys_first, tokenize=False, add_generation_prompt=True).startswith(
        "<|im_start|>system\nX<|im_end|>\n<|im_start|>user")
    sdar = _tokenizer(ckpt["sdar"])
    assert sdar.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, enable_thinking=False) == (
        EXPECTED_CHAT["sdar"] + "<think>\n\n</think>\n\n")
    assert (ckpt["sdar"] / "chat_template.jinja").exists()
    assert "chat_template" not in json.loads((ckpt["sdar"] / "tokenizer_config.json").read_text())


# ---------------------------------------------------------------------------------------------
# reference forward: building blocks
# ---------------------------------------------------------------------------------------------

def test_rope_pairs_half_split_and_partial():
    theta, rot, length = 10000.0, 8, 5
    cos, sin = rf.rope_cos_sin(length, rot, theta)
    for j in range(rot // 2):
        x = torch.zeros(length, 12)
        x[:, j] = 1.0
        x[:, 10] = 3.0  # beyond rot_dim: untouched
        y = rf.apply_rope(x, cos, sin)
        angle = torch.arange(length) * theta ** (-2 * j / rot)
        torch.testing.assert_close(y[:, j], angle.cos(), atol=1e-6, rtol=0)
        torch.testing.assert_close(y[:, j + rot // 2], angle.sin(), atol=1e-6, rtol=0)
        assert torch.all(y[:, 10] == 3.0)
        assert y[:, [c for c in range(rot) if c not in (j, j + rot // 2)]].abs().max() == 0
    x = torch.randn(length, 12)
    torch.testing.assert_close(rf.apply_rope(x, cos, sin)[0], x[0])  # position 0 is the identity


def test_attention_masks():
    a = rf.attention_allowed(6, "block_causal:2")
    assert a.tolist()[0] == [True, True, False, False, False, False]
    assert a.tolist()[3] == [True, True, True, True, False, False]
    assert torch.equal(rf.attention_allowed(6, "block_causal:1"), rf.attention_allowed(6, "causal"))
    assert rf.attention_allowed(6, "block_causal:6").all() and rf.attention_allowed(6, "bidirectional").all()
    with pytest.raises(ValueError):
        rf.attention_allowed(4, "sliding:2")


def test_rms_norm_matches_definition():
    x, w = torch.randn(3, 8), torch.randn(8)
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(rf.rms_norm(x, w, 1e-6), expected)


def _logit(p: list[float]) -> torch.Tensor:
    t = torch.tensor(p, dtype=torch.float64)
    return (t / (1 - t)).log().float()


def test_moe_route_group_limited():
    cfg = {"n_group": 4, "topk_group": 2, "num_experts_per_tok": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True}
    s = [0.9, 0.1, 0.6, 0.58, 0.2, 0.2, 0.95, 0.02]  # expert 6 is the best but its group (0.97) loses
    experts, weights = rf.moe_route(_logit(s), None, cfg)
    assert sorted(experts.tolist()) == [0, 2]
    got = dict(zip(experts.tolist(), weights.tolist()))
    assert math.isclose(got[0], 0.9 / 1.5 * 2.5, rel_tol=1e-5) and math.isclose(got[2], 0.6 / 1.5 * 2.5, rel_tol=1e-5)
    # the bias changes the selection only; weights use the unbiased scores
    bias = torch.tensor([0, 0, 0, 0.5, 0, 0, 0, 0])
    experts, weights = rf.moe_route(_logit(s), bias, cfg)
    got = dict(zip(experts.tolist(), weights.tolist()))
    assert sorted(got) == [0, 3]
    assert math.isclose(got[3], 0.58 / 1.48 * 2.5, rel_tol=1e-5) and math.isclose(got[0], 0.9 / 1.48 * 2.5, rel_tol=1e-5)


def test_moe_route_group_score_is_top2_sum():
    # groups of 4: g0 wins on max, g2 wins on the full sum, g1 wins on the sum of its top 2
    cfg = {"n_group": 3, "topk_group": 1, "num_experts_per_tok": 2, "routed_scaling_factor": 1.0}
    s = [0.9, 0.1, 0.1, 0.1, 0.56, 0.54, 0.01, 0.01, 0.32, 0.32, 0.32, 0.32]
    experts, weights = rf.moe_route(_logit(s), None, cfg)
    assert sorted(experts.tolist()) == [4, 5]
    assert math.isclose(weights.sum().item(), 1.0, rel_tol=1e-6)


def test_tiny_llada2_router_uses_bias_and_input(ckpt):
    cfg, w = rf.load_config(ckpt["llada2"]), rf.load_weights(ckpt["llada2"])
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    with_bias = [tuple(sorted(rf.moe_route(r @ w["model.layers.1.mlp.gate.weight"].T,
                                           w["model.layers.1.mlp.gate.expert_bias"], cfg)[0].tolist())) for r in x]
    no_bias = [tuple(sorted(rf.moe_route(r @ w["model.layers.1.mlp.gate.weight"].T, None, cfg)[0].tolist())) for r in x]
    assert len(set(with_bias)) >= 3  # selection depends on the token
    assert with_bias != no_bias  # and on the bias


# ---------------------------------------------------------------------------------------------
# reference forward: whole models
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_reference_runs_and_is_deterministic(ckpt, tmp_path, family):
    cfg = rf.load_config(ckpt[family])
    ids = _ids(12, 0)
    ids[0, 5] = tc.MASK_TOKENS[family][1]  # real mask id must be a valid row
    a = rf.reference_logits(ckpt[family], ids, "bidirectional")
    b = rf.reference_logits(ckpt[family], ids, "bidirectional")
    assert a.shape == (1, 12, cfg["vocab_size"]) and a.dtype == torch.float32
    assert torch.equal(a, b) and torch.isfinite(a).all()
    assert 0.05 < a.std().item() < 1.0  # not degenerate
    other = tc.FAMILIES[family](tmp_path / "seed1", seed=1)
    assert (rf.reference_logits(other, ids, "bidirectional") - a).abs().max() > 0.1


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_block_causal_semantics(ckpt, family):
    d, block, length = ckpt[family], 4, 12
    base = _ids(length, 1)
    late = base.clone()
    late[0, 8:] = _ids(4, 2)  # change only block 2
    mid = base.clone()
    mid[0, 6] = (mid[0, 6] + 1) % 700  # change one token of block 1

    cfg, w = rf.load_config(d), rf.load_weights(d)

    def run(ids, att):
        return rf.logits_from_weights(cfg, w, ids, att)[0]

    bc = f"block_causal:{block}"
    b0, b_late, b_mid = run(base, bc), run(late, bc), run(mid, bc)
    # block-causal: earlier blocks never see later ones
    torch.testing.assert_close(b_late[:8], b0[:8], atol=0, rtol=0)
    torch.testing.assert_close(b_mid[:4], b0[:4], atol=0, rtol=0)
    # ... but the whole own block is visible (bidirectional inside the block), unlike causal
    assert (b_mid[4:6] - b0[4:6]).abs().max() > 1e-3
    c0, c_mid = run(base, "causal"), run(mid, "causal")
    torch.testing.assert_close(c_mid[:6], c0[:6], atol=0, rtol=0)
    # bidirectional: every position sees the change
    f0, f_late = run(base, "bidirectional"), run(late, "bidirectional")
    assert (f_late[:4] - f0[:4]).abs().amax(-1).min() > 1e-3
    # degenerate block sizes
    torch.testing.assert_close(run(base, "block_causal:1"), c0, atol=1e-6, rtol=0)
    torch.testing.assert_close(run(base, f"block_causal:{length}"), f0, atol=1e-6, rtol=0)
    # (the last block's rows still differ between the two masks: from layer 2 on they read keys of
    # earlier rows whose hidden states depend on the mask; see the one-layer test below)
    assert (b0[8:] - f0[8:]).abs().max() > 1e-3


LAYER_KEY = {"llada": "n_layers", "dream": "num_hidden_layers", "sdar": "num_hidden_layers",
             "fast_dllm_v2": "num_hidden_layers", "llada2": "num_hidden_layers"}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_one_layer_last_block_sees_everything(tmp_path, family):
    """With a single layer the last block's rows attend to all keys under both masks -> equal."""
    d = tc.FAMILIES[family](tmp_path / family, **{LAYER_KEY[family]: 1})
    ids = _ids(12, 6)
    b, f = rf.reference_logits(d, ids, "block_causal:4")[0], rf.reference_logits(d, ids, "bidirectional")[0]
    torch.testing.assert_close(b[8:], f[8:], atol=1e-6, rtol=0)
    assert (b[:8] - f[:8]).abs().amax(-1).min() > 1e-3


@pytest.mark.parametrize("family", ["dream", "fast_dllm_v2"])
def test_reference_has_no_shift(ckpt, family):
    """Causal raw row i depends on tokens <= i only: the caller, not the reference, shifts."""
    d = ckpt[family]
    ids = _ids(6, 4)
    changed = ids.clone()
    changed[0, 3] += 1
    a, b = rf.reference_logits(d, ids, "causal")[0], rf.reference_logits(d, changed, "causal")[0]
    assert torch.equal(a[:3], b[:3]) and (a[3] - b[3]).abs().max() > 1e-3


def test_sharded_bf16_reference_matches_single(ckpt, tmp_path):
    d1 = tc.make_llada2(tmp_path / "bf", dtype="bfloat16")
    d2 = tc.make_llada2(tmp_path / "bf_sh", dtype="bfloat16", sharded=True)
    ids = _ids(8, 5)
    a, b = rf.reference_logits(d1, ids, "block_causal:4"), rf.reference_logits(d2, ids, "block_causal:4")
    assert torch.equal(a, b)
    # the bf16 checkpoint is the fp32 one rounded: logits agree to bf16 precision
    c = rf.reference_logits(ckpt["llada2"], ids, "block_causal:4")
    assert 0 < (a - c).abs().max() < 0.05


# ---------------------------------------------------------------------------------------------
# independent cross-check: the reference against transformers' own Llama / Qwen2 / Qwen3 /
# Glm4Moe implementations (same math as LLaDA / Dream & Fast-dLLM v2 / SDAR / LLaDA2), weights
# renamed, under each mask passed as a 4-D additive mask to eager attention.
# ---------------------------------------------------------------------------------------------

def _rope_kwargs(config_cls, theta: float, partial: float | None = None) -> dict:
    if "rope_parameters" in inspect.signature(config_cls.__init__).parameters:
        params = {"rope_type": "default", "rope_theta": theta}
        if partial is not None:
            params["partial_rotary_factor"] = partial
        return {"rope_parameters": params}
    return {"rope_theta": theta}


def _llama(cfg, w):
    import transformers as T

    c = T.LlamaConfig(vocab_size=cfg["vocab_size"], hidden_size=cfg["d_model"], intermediate_size=cfg["mlp_hidden_size"],
                      num_hidden_layers=cfg["n_layers"], num_attention_heads=cfg["n_heads"],
                      num_key_value_heads=cfg["n_kv_heads"], rms_norm_eps=cfg["rms_norm_eps"],
                      tie_word_embeddings=False, **_rope_kwargs(T.LlamaConfig, cfg["rope_theta"]))
    ren = {"attn_norm": "input_layernorm", "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
           "v_proj": "self_attn.v_proj", "attn_out": "self_attn.o_proj", "ff_norm": "post_attention_layernorm",
           "ff_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "ff_out": "mlp.down_proj"}
    sd = {"model.embed_tokens.weight": w["model.transformer.wte.weight"],
          "model.norm.weight": w["model.transformer.ln_f.weight"], "lm_head.weight": w["model.transformer.ff_out.weight"]}
    for i in range(cfg["n_layers"]):
        sd.update({f"model.layers.{i}.{b}.weight": w[f"model.transformer.blocks.{i}.{a}.weight"] for a, b in ren.items()})
    return T.LlamaForCausalLM(c), sd


def _qwen(cfg, w, qwen3: bool):
    import transformers as T

    cls = T.Qwen3Config if qwen3 else T.Qwen2Config
    extra = {"head_dim": cfg["head_dim"]} if qwen3 else {}
    c = cls(vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"], rms_norm_eps=cfg["rms_norm_eps"], tie_word_embeddings=False,
            **extra, **_rope_kwargs(cls, cfg["rope_theta"]))
    model = T.Qwen3ForCausalLM(c) if qwen3 else T.Qwen2ForCausalLM(c)
    return model, w


def _glm4_moe(cfg, w):
    import transformers as T

    c = T.Glm4MoeConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"], rms_norm_eps=cfg["rms_norm_eps"],
        partial_rotary_factor=cfg["partial_rotary_factor"], tie_word_embeddings=False, attention_bias=False,
        use_qk_norm=True, moe_intermediate_size=cfg["moe_intermediate_size"], n_routed_experts=cfg["num_experts"],
        n_shared_experts=cfg["num_shared_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
        n_group=cfg["n_group"], topk_group=cfg["topk_group"], routed_scaling_factor=cfg["routed_scaling_factor"],
        norm_topk_prob=True, first_k_dense_replace=cfg["first_k_dense_replace"],
        **_rope_kwargs(T.Glm4MoeConfig, cfg["rope_theta"], cfg["partial_rotary_factor"]))
    hd, nq, nkv, n_exp = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_experts"]
    sd = {"model.embed_tokens.weight": w["model.word_embeddings.weight"], "model.norm.weight": w["model.norm.weight"],
          "lm_head.weight": w["lm_head.weight"]}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        q, k, v = w[p + "attention.query_key_value.weight"].split([nq * hd, nkv * hd, nkv * hd])
        sd.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
                   p + "self_attn.o_proj.weight": w[p + "attention.dense.weight"],
                   p + "self_attn.q_norm.weight": w[p + "attention.query_layernorm.weight"],
                   p + "self_attn.k_norm.weight": w[p + "attention.key_layernorm.weight"],
                   p + "input_layernorm.weight": w[p + "input_layernorm.weight"],
                   p + "post_attention_layernorm.weight": w[p + "post_attention_layernorm.weight"]})
        names = ("gate_proj", "up_proj", "down_proj")
        if i < cfg["first_k_dense_replace"]:
            sd.update({p + f"mlp.{n}.weight": w[p + f"mlp.{n}.weight"] for n in names})
            continue
        sd[p + "mlp.gate.weight"] = w[p + "mlp.gate.weight"]
        sd[p + "mlp.gate.e_score_correction_bias"] = w[p + "mlp.gate.expert_bias"]
        sd[p + "mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([w[p + f"mlp.experts.{e}.gate_proj.weight"], w[p + f"mlp.experts.{e}.up_proj.weight"]])
             for e in range(n_exp)])
        sd[p + "mlp.experts.down_proj"] = torch.stack([w[p + f"mlp.experts.{e}.down_proj.weight"] for e in range(n_exp)])
        sd.update({p + f"mlp.shared_experts.{n}.weight": w[p + f"mlp.shared_experts.{n}.weight"] for n in names})
    return T.Glm4MoeForCausalLM(c), sd


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_reference_matches_transformers_equivalent(ckpt, family):
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("cross-check written against the transformers 5 module layout (fused MoE experts)")
    cfg, w = rf.load_config(ckpt[family]), rf.load_weights(ckpt[family])
    if family == "llada":
        model, sd = _llama(cfg, w)
    elif family == "llada2":
        model, sd = _glm4_moe(cfg, w)
    else:
        model, sd = _qwen(cfg, w, qwen3=family == "sdar")
    model.load_state_dict(sd, strict=True)
    model.config._attn_implementation = "eager"
    model.eval()
    ids = _ids(13, 7)
    for att in ("causal", "bidirectional", "block_causal:4"):
        allowed = rf.attention_allowed(13, att)
        mask = torch.zeros(1, 1, 13, 13).masked_fill(~allowed, torch.finfo(torch.float32).min)
        with torch.no_grad():
            theirs = model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(rf.reference_logits(ckpt[family], ids, att), theirs, atol=2e-6, rtol=0)
