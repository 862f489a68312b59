"""Tiny random checkpoints in each diffusion-LM family's real on-disk layout.

Every `make_<family>` writes a directory that the engine's loader must read with exactly the code
path it uses for the real download: same config.json keys, same safetensors names and shape
*pattern*, same special-token ids and strings, same chat-template file placement. Only the widths
are tiny (hidden 32, 2-3 layers); the vocabulary keeps its real size because the special ids
(mask 126336, 151666, ...) must stay valid.

All facts come from docs/families.md (copy at /work/shared/reference/families.md); section numbers
are cited next to each family. Values that the sheet marks [UNVERIFIED] are chosen conservatively
and flagged in comments.

Tokenizers are byte-level BPE (256 byte symbols + a few hundred chain merges) built with the
`tokenizers` library, with the family's special tokens inserted at their real (non-contiguous)
ids. `tokenizers` keeps a token's id when the token is also present in the model vocabulary, so
the specials are put in both the BPE vocab and `added_tokens`.

Config overrides: `make_x(dir, num_hidden_layers=3)` replaces a config key; passing the sentinel
`DROP` removes it (e.g. `make_sdar(dir, block_size=DROP)` mimics a config without the key).
Weights follow the config after overrides.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

DROP: Any = object()  # override value meaning "remove this key from config.json"

INIT_STD = 0.02  # std of every random matrix / bias ...
# ... except the query/key projections: with std 0.02 on width 32 the attention scores are ~0.01,
# softmax is nearly uniform and a RoPE bug moves the logits by only ~0.3 % (measured). 0.15 gives
# O(1) scores so position handling is visible at bf16 tolerances. qk-norm families are unaffected.
QK_STD = 0.15
NORM_NOISE = 0.1  # norm weights are 1 + NORM_NOISE * randn so that they are exercised

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# --------------------------------------------------------------------------------------------
# generic writers
# --------------------------------------------------------------------------------------------

def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported checkpoint dtype {dtype}")
    return dtype


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _apply_overrides(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = dict(config)
    for key, value in overrides.items():
        if value is DROP:
            out.pop(key, None)
        else:
            out[key] = value
    return out


class _Init:
    """Deterministic random tensors; the draw order is the order of the calls."""

    def __init__(self, seed: int, std: float = INIT_STD):
        self.gen = torch.Generator().manual_seed(seed)
        self.std = std

    def matrix(self, *shape: int, std: float | None = None) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen) * (self.std if std is None else std)

    def norm(self, n: int) -> torch.Tensor:
        return 1.0 + NORM_NOISE * torch.randn(n, generator=self.gen)


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_safetensors(out_dir: Path, tensors: dict[str, torch.Tensor], *, sharded: bool) -> None:
    """`model.safetensors`, or two shards + `model.safetensors.index.json` (HF sharding layout)."""
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    meta = {"format": "pt"}  # what transformers' save_pretrained writes
    if not sharded:
        save_file(tensors, str(out_dir / "model.safetensors"), metadata=meta)
        return
    total = sum(_tensor_bytes(t) for t in tensors.values())
    names = list(tensors)
    shards: list[list[str]] = [[], []]
    running = 0
    for name in names:  # first shard until half of the bytes, like a size-capped split
        shards[0 if running < total / 2 else 1].append(name)
        running += _tensor_bytes(tensors[name])
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in shard}, str(out_dir / fname), metadata=meta)
        weight_map.update({n: fname for n in shard})
    _write_json(out_dir / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tok:
    """One added token: real string, real id, whether it is a 'special' token."""

    content: str
    id: int
    special: bool = True


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte -> printable unicode map used by ByteLevel pre-tokenizers (Qwen, Llama-3)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


# Words that get a multi-byte token each (chain merges left to right). "Ġ" = leading space.
_WORDS = (
    "the of and to in is that for it as with was on be by at this are from or have an not but "
    "which one all were can there their has been more if will would what when who so no out up "
    "about into than them some could other only then its also two first new time like just over "
    "def return print import self class while else elif true false none int str list dict len range "
    "hello world answer question user assistant system number sum total because therefore let "
    "step write code function python"
).split()


def _bpe_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    b2u = _bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    merges: list[tuple[str, str]] = []
    pieces = [w for word in _WORDS for w in (word, "Ġ" + word)] + ["ĠĠ", "ĠĠĠĠ", "ĊĊ", "Ġ="]
    for piece in pieces:
        cur = piece[0]
        for ch in piece[1:]:
            nxt = cur + ch
            if nxt not in vocab:
                vocab[nxt] = len(vocab)
                merges.append((cur, ch))
            cur = nxt
    return vocab, merges


def build_tokenizer_json(tokens: Iterable[Tok]) -> str:
    """Serialized `tokenizer.json`: byte-level BPE (ids 0..~700) + added tokens at real ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab, merges = _bpe_vocab_and_merges()
    tokens = list(tokens)
    for t in tokens:  # also in the model vocab, otherwise tokenizers renumbers them on load
        assert t.id >= len(vocab) and t.content not in vocab, t
        vocab[t.content] = t.id
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t.content, special=t.special, normalized=False) for t in tokens if not t.special])
    tok.add_special_tokens([AddedToken(t.content, special=True, normalized=False) for t in tokens if t.special])
    for t in tokens:
        assert tok.token_to_id(t.content) == t.id, (t, tok.token_to_id(t.content))
    return tok.to_str(pretty=True)


def _added_tokens_decoder(tokens: Iterable[Tok]) -> dict[str, dict[str, Any]]:
    return {str(t.id): {"content": t.content, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": t.special}
            for t in sorted(tokens, key=lambda t: t.id)}


def write_tokenizer(out_dir: Path, tokens: list[Tok], tokenizer_config: dict[str, Any],
                    special_tokens_map: dict[str, Any], *, chat_template: str,
                    template_in_jinja_file: bool = False, qwen_vocab_files: bool = False) -> None:
    """tokenizer.json + tokenizer_config.json + special_tokens_map.json (+ chat_template.jinja,
    + vocab.json/merges.txt as in Qwen repositories)."""
    (out_dir / "tokenizer.json").write_text(build_tokenizer_json(tokens), encoding="utf-8")
    cfg = {"added_tokens_decoder": _added_tokens_decoder(tokens), **tokenizer_config}
    if template_in_jinja_file:
        (out_dir / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    else:
        cfg["chat_template"] = chat_template
    _write_json(out_dir / "tokenizer_config.json", cfg)
    _write_json(out_dir / "special_tokens_map.json", special_tokens_map)
    if qwen_vocab_files:
        vocab, merges = _bpe_vocab_and_merges()
        _write_json(out_dir / "vocab.json", vocab)
        (out_dir / "merges.txt").write_text(
            "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")


# --------------------------------------------------------------------------------------------
# chat templates (written here from the descriptions in families.md)
# --------------------------------------------------------------------------------------------

# families.md 1.4: Llama-3-like headers, BOS before the first message only, assistant header always appended.
LLADA_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first -%}{{ bos_token }}{%- endif -%}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + (message['content'] | trim) + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
)


def _chatml_template(default_system: str | None, thinking_switch: bool) -> str:
    """Qwen ChatML. families.md 2.4 (Dream, default system prompt), 3.4 (SDAR, Qwen3: no default
    system, empty think block when enable_thinking is false), 4.1 (Fast-dLLM v2, Qwen2.5)."""
    parts = []
    if default_system is not None:
        parts.append(
            "{%- if messages | length == 0 or messages[0]['role'] != 'system' -%}"
            "{{ '<|im_start|>system\\n" + default_system + "<|im_end|>\\n' }}"
            "{%- endif -%}")
    parts.append(
        "{%- for message in messages -%}"
        "{%- set content = message['content'] -%}"
        "{%- if message['role'] == 'assistant' and '</think>' in content -%}"
        "{%- set content = (content.split('</think>') | last) | trim -%}"
        "{%- endif -%}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}")
    if thinking_switch:
        parts.append("{%- if enable_thinking is defined and enable_thinking is false -%}"
                     "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}")
    parts.append("{%- endif -%}")
    return "".join(parts)


DREAM_CHAT_TEMPLATE = _chatml_template("You are a helpful assistant.", thinking_switch=False)
# Qwen2.5-Instruct's own default system prompt (Fast-dLLM v2 keeps the Qwen2.5 tokenizer) [UNVERIFIED].
FAST_DLLM_V2_CHAT_TEMPLATE = _chatml_template(
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.", thinking_switch=False)
SDAR_CHAT_TEMPLATE = _chatml_template(None, thinking_switch=True)

# families.md 5.4 (dInfer format); the HF template itself is [UNVERIFIED]: no default system prompt here.
LLADA2_CHAT_TEMPLATE = (
    "{%- set names = {'system': 'SYSTEM', 'user': 'HUMAN', 'assistant': 'ASSISTANT', 'tool': 'OBSERVATION'} -%}"
    "{%- for message in messages -%}"
    "{{ '<role>' + names.get(message['role'], message['role'] | upper) + '</role>' + message['content'] + '<|role_end|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<role>ASSISTANT</role>' }}{%- endif -%}"
)


# --------------------------------------------------------------------------------------------
# shared pieces of the Qwen-style families (Dream, SDAR, Fast-dLLM v2)
# --------------------------------------------------------------------------------------------

def _qwen_tensors(cfg: dict[str, Any], init: _Init, *, qkv_bias: bool, qk_norm: bool) -> dict[str, torch.Tensor]:
    """HF Qwen2 / Qwen3 parameter names (families.md 2.2, 3.2, 4.2)."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    n_q, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // n_q
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": init.matrix(vocab, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = init.norm(h)
        for name, rows, std in (("q_proj", n_q * hd, QK_STD), ("k_proj", n_kv * hd, QK_STD), ("v_proj", n_kv * hd, None)):
            t[p + f"self_attn.{name}.weight"] = init.matrix(rows, h, std=std)
            if qkv_bias:
                t[p + f"self_attn.{name}.bias"] = init.matrix(rows)
        t[p + "self_attn.o_proj.weight"] = init.matrix(h, n_q * hd)
        if qk_norm:
            t[p + "self_attn.q_norm.weight"] = init.norm(hd)
            t[p + "self_attn.k_norm.weight"] = init.norm(hd)
        t[p + "post_attention_layernorm.weight"] = init.norm(h)
        t[p + "mlp.gate_proj.weight"] = init.matrix(inter, h)
        t[p + "mlp.up_proj.weight"] = init.matrix(inter, h)
        t[p + "mlp.down_proj.weight"] = init.matrix(h, inter)
    t["model.norm.weight"] = init.norm(h)
    if not cfg.get("tie_word_embeddings", False):
        t["lm_head.weight"] = init.matrix(vocab, h)
    return t


def _qwen_common_config(vocab_size: int, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": 32,
        "initializer_range": 0.02,
        "intermediate_size": 64,
        "max_position_embeddings": 4096,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": _DTYPE_NAMES[dtype],
        "use_cache": False,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def _finish(out_dir: Path, cfg: dict[str, Any], tensors: dict[str, torch.Tensor],
            dtype: torch.dtype, sharded: bool) -> Path:
    _write_json(out_dir / "config.json", dict(sorted(cfg.items())))
    write_safetensors(out_dir, {k: v.to(dtype) for k, v in tensors.items()}, sharded=sharded)
    return out_dir


def _prepare(out_dir: Path | str, dtype: torch.dtype | str) -> tuple[Path, torch.dtype]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out, _as_dtype(dtype)


# --------------------------------------------------------------------------------------------
# LLaDA-8B-Instruct (families.md section 1)
# --------------------------------------------------------------------------------------------

LLADA_TOKENS = [
    Tok("<|startoftext|>", 126080), Tok("<|endoftext|>", 126081), Tok("[CLS]", 126082), Tok("[gMASK]", 126083),
    Tok("<|mdm_mask|>", 126336), Tok("<role>", 126340), Tok("</role>", 126341),
    Tok("<|start_header_id|>", 126346), Tok("<|end_header_id|>", 126347), Tok("<|eot_id|>", 126348),
]


def llada_config(dtype: torch.dtype = torch.float32, **overrides: Any) -> dict[str, Any]:
    """OLMo-style keys of LLaDA's config.json (1.1) with tiny sizes; MHA (n_kv_heads = n_heads)."""
    cfg = {
        "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0,
        "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
        "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                     "AutoModel": "modeling_llada.LLaDAModelLM",
                     "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"},
        "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama",
        "d_model": 32, "embedding_dropout": 0.0, "embedding_size": 126464,
        "eos_token_id": 126081, "flash_attention": False, "include_bias": False, "include_qkv_bias": False,
        "init_cutoff_factor": None, "init_device": "meta", "init_fn": "mitchell", "init_std": 0.02,
        "input_emb_norm": False, "layer_norm_type": "rms", "layer_norm_with_affine": True,
        "mask_token_id": 126336, "max_sequence_length": 4096,
        "mlp_hidden_size": 64, "mlp_ratio": 4,  # mlp_ratio*d_model = 128 != 64: mlp_hidden_size must win
        "model_type": "llada", "multi_query_attention": None,
        "n_heads": 4, "n_kv_heads": 4, "n_layers": 2,
        "pad_token_id": 126081, "precision": "amp_bf16", "residual_dropout": 0.0,
        "rms_norm_eps": 1e-05, "rope": True, "rope_full_precision": True, "rope_theta": 500000.0,
        "scale_logits": False, "torch_dtype": _DTYPE_NAMES[dtype], "transformers_version": "4.46.2",
        "use_cache": False, "vocab_size": 126464, "weight_tying": False,
    }
    return _apply_overrides(cfg, overrides)


def llada_tensors(cfg: dict[str, Any], init: _Init) -> dict[str, torch.Tensor]:
    """Names/shapes of families.md 1.2 (`model.transformer.*`, no biases)."""
    d, n_h, n_kv = cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"]
    hd = d // n_h
    ff = cfg.get("mlp_hidden_size") or cfg["mlp_ratio"] * d
    vocab = cfg["embedding_size"] or cfg["vocab_size"]
    t: dict[str, torch.Tensor] = {"model.transformer.wte.weight": init.matrix(vocab, d)}
    for i in range(cfg["n_layers"]):
        p = f"model.transformer.blocks.{i}."
        t[p + "attn_norm.weight"] = init.norm(d)
        t[p + "q_proj.weight"] = init.matrix(n_h * hd, d, std=QK_STD)
        t[p + "k_proj.weight"] = init.matrix(n_kv * hd, d, std=QK_STD)
        t[p + "v_proj.weight"] = init.matrix(n_kv * hd, d)
        t[p + "attn_out.weight"] = init.matrix(d, n_h * hd)
        t[p + "ff_norm.weight"] = init.norm(d)
        t[p + "ff_proj.weight"] = init.matrix(ff, d)  # gate
        t[p + "up_proj.weight"] = init.matrix(ff, d)
        t[p + "ff_out.weight"] = init.matrix(d, ff)  # down
    t["model.transformer.ln_f.weight"] = init.norm(d)
    if not cfg["weight_tying"]:
        t["model.transformer.ff_out.weight"] = init.matrix(vocab, d)
    return t


def make_llada(out_dir: Path, *, seed: int = 0, dtype: torch.dtype | str = torch.float32,
               sharded: bool = False, **overrides: Any) -> Path:
    out, dt = _prepare(out_dir, dtype)
    cfg = llada_config(dt, **overrides)
    _write_json(out / "generation_config.json",
                {"_from_model_config": True, "bos_token_id": 126080, "eos_token_id": 126081,
                 "transformers_version": "4.46.2"})
    # 1.4: PreTrainedTokenizerFast, add_bos/add_eos false, no mask_token (mask id comes from config.json).
    write_tokenizer(
        out, LLADA_TOKENS,
        {"add_bos_token": False, "add_eos_token": False, "bos_token": "<|startoftext|>",
         "clean_up_tokenization_spaces": False, "cls_token": "[CLS]", "eos_token": "<|endoftext|>",
         "model_max_length": 1000000000000000019884624838656, "pad_token": "<|endoftext|>",
         "tokenizer_class": "PreTrainedTokenizerFast"},
        {"bos_token": "<|startoftext|>", "cls_token": "[CLS]", "eos_token": "<|endoftext|>",
         "pad_token": "<|endoftext|>"},
        chat_template=LLADA_CHAT_TEMPLATE)
    return _finish(out, cfg, llada_tensors(cfg, _Init(seed)), dt, sharded)


# --------------------------------------------------------------------------------------------
# Dream-v0-Instruct-7B (families.md section 2)
# --------------------------------------------------------------------------------------------

QWEN_CHAT_TOKENS = [Tok("<|endoftext|>", 151643), Tok("<|im_start|>", 151644), Tok("<|im_end|>", 151645)]
DREAM_TOKENS = [*QWEN_CHAT_TOKENS, Tok("<|beginoftext|>", 151665), Tok("<|mask|>", 151666)]


def dream_config(dtype: torch.dtype = torch.float32, **overrides: Any) -> dict[str, Any]:
    cfg = {
        **_qwen_common_config(152064, dtype),
        "architectures": ["DreamModel"],
        "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
        "bos_token_id": 151643, "eos_token_id": 151643, "pad_token_id": 151643, "mask_token_id": 151666,
        "max_window_layers": overrides.get("num_hidden_layers", 2), "model_type": "Dream", "sliding_window": None,
        "transformers_version": "4.46.2",
    }
    return _apply_overrides(cfg, overrides)


def _qwen_tokenizer_config(eos: str, pad: str, extra_specials: list[str], mask: str | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "additional_special_tokens": extra_specials, "bos_token": None, "clean_up_tokenization_spaces": False,
        "eos_token": eos, "errors": "replace", "model_max_length": 131072, "pad_token": pad,
        "split_special_tokens": False, "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": None,
    }
    if mask is not None:
        cfg["mask_token"] = mask
    return cfg


def _special_map(cfg: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token", "eos_token", "pad_token", "mask_token", "unk_token", "cls_token",
            "additional_special_tokens")
    return {k: cfg[k] for k in keys if cfg.get(k) is not None}


def make_dream(out_dir: Path, *, seed: int = 0, dtype: torch.dtype | str = torch.float32,
               sharded: bool = False, **overrides: Any) -> Path:
    out, dt = _prepare(out_dir, dtype)
    cfg = dream_config(dt, **overrides)
    # 2.1/2.4: the real repo ships a custom DreamTokenizer (Qwen2 BPE, eos/pad <|endoftext|>, no bos,
    # mask_token <|mask|>); here the same specials through PreTrainedTokenizerFast.
    tok_cfg = _qwen_tokenizer_config("<|endoftext|>", "<|endoftext|>",
                                     ["<|im_start|>", "<|im_end|>", "<|beginoftext|>", "<|mask|>"], "<|mask|>")
    write_tokenizer(out, DREAM_TOKENS, tok_cfg, _special_map(tok_cfg), chat_template=DREAM_CHAT_TEMPLATE,
                    qwen_vocab_files=True)
    tensors = _qwen_tensors(cfg, _Init(seed), qkv_bias=True, qk_norm=False)
    return _finish(out, cfg, tensors, dt, sharded)


# --------------------------------------------------------------------------------------------
# SDAR-*-Chat (families.md section 3)
# --------------------------------------------------------------------------------------------

SDAR_TOKENS = [*QWEN_CHAT_TOKENS, Tok("<think>", 151667, special=False), Tok("</think>", 151668, special=False),
               Tok("<|MASK|>", 151669)]


def sdar_config(dtype: torch.dtype = torch.float32, **overrides: Any) -> dict[str, Any]:
    cfg = {
        **_qwen_common_config(151936, dtype),
        "architectures": ["SDARForCausalLM"],
        "attention_bias": False, "attn_implementation": "flex_attention",
        "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
                     "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
        "block_size": 4,  # 3.1: present in the training-folder config; may be absent on HF -> DROP to test
        "bos_token_id": 151643, "eos_token_id": 151643, "fuse_cross_entropy": True, "head_dim": 8,
        "mask_token_id": 151669,  # same remark as block_size
        "max_window_layers": overrides.get("num_hidden_layers", 2),  # = n_layers in the release (3.1)
        "model_type": "sdar", "sliding_window": None, "transformers_version": "4.52.4",
    }
    return _apply_overrides(cfg, overrides)


def make_sdar(out_dir: Path, *, seed: int = 0, dtype: torch.dtype | str = torch.float32,
              sharded: bool = False, **overrides: Any) -> Path:
    out, dt = _prepare(out_dir, dtype)
    cfg = sdar_config(dt, **overrides)
    _write_json(out / "generation_config.json",
                {"do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
                 "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.52.4"})
    # 3.4: eos/pad <|endoftext|>, bos null, mask_token <|MASK|>; template in chat_template.jinja.
    tok_cfg = _qwen_tokenizer_config("<|endoftext|>", "<|endoftext|>", ["<|im_start|>", "<|im_end|>"], "<|MASK|>")
    write_tokenizer(out, SDAR_TOKENS, tok_cfg, _special_map(tok_cfg), chat_template=SDAR_CHAT_TEMPLATE,
                    template_in_jinja_file=True, qwen_vocab_files=True)
    tensors = _qwen_tensors(cfg, _Init(seed), qkv_bias=False, qk_norm=True)
    return _finish(out, cfg, tensors, dt, sharded)


# --------------------------------------------------------------------------------------------
# Fast-dLLM v2 (families.md section 4)
# --------------------------------------------------------------------------------------------

FAST_DLLM_V2_TOKENS = [*QWEN_CHAT_TOKENS, Tok("|<MASK>|", 151665)]


def fast_dllm_v2_config(dtype: torch.dtype = torch.float32, **overrides: Any) -> dict[str, Any]:
    """7B-like (untied, vocab 152064). `tie_word_embeddings=True` gives the 1.5B layout (no lm_head)."""
    n_layers = overrides.get("num_hidden_layers", 2)
    cfg = {
        **_qwen_common_config(152064, dtype),
        "architectures": ["Fast_dLLM_QwenForCausalLM"],
        "auto_map": {"AutoConfig": "configuration.Fast_dLLM_QwenConfig", "AutoModel": "modeling.Fast_dLLM_QwenModel",
                     "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"},
        "bd_size": 32, "bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": 151645,
        "layer_types": ["full_attention"] * n_layers, "max_window_layers": n_layers,
        "model_type": "Fast_dLLM_Qwen", "sliding_window": None, "transformers_version": "4.53.1",
    }
    return _apply_overrides(cfg, overrides)


def make_fast_dllm_v2(out_dir: Path, *, seed: int = 0, dtype: torch.dtype | str = torch.float32,
                      sharded: bool = False, **overrides: Any) -> Path:
    out, dt = _prepare(out_dir, dtype)
    cfg = fast_dllm_v2_config(dt, **overrides)
    # 4.1: the mask `|<MASK>|` is an added special token, NOT the tokenizer's mask_token; eos <|im_end|>,
    # tokenizer pad <|endoftext|>.
    tok_cfg = _qwen_tokenizer_config("<|im_end|>", "<|endoftext|>", ["<|im_start|>", "<|im_end|>", "|<MASK>|"], None)
    write_tokenizer(out, FAST_DLLM_V2_TOKENS, tok_cfg, _special_map(tok_cfg),
                    chat_template=FAST_DLLM_V2_CHAT_TEMPLATE, qwen_vocab_files=True)
    tensors = _qwen_tensors(cfg, _Init(seed), qkv_bias=True, qk_norm=False)
    return _finish(out, cfg, tensors, dt, sharded)


# --------------------------------------------------------------------------------------------
# LLaDA2.0-mini (families.md section 5)
# --------------------------------------------------------------------------------------------

# Role-token ids are [UNVERIFIED] (not in families.md); chosen above the verified ids.
LLADA2_TOKENS = [Tok("<|endoftext|>", 156892), Tok("<|mask|>", 156895),
                 Tok("<role>", 156900), Tok("</role>", 156901), Tok("<|role_end|>", 156902)]


def llada2_config(dtype: torch.dtype = torch.float32, **overrides: Any) -> dict[str, Any]:
    cfg = {
        "architectures": ["LLaDA2MoeModelLM"],
        "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                     "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                     "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
        "eos_token_id": 156892, "first_k_dense_replace": 1, "head_dim": 16, "hidden_act": "silu",
        "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64, "max_position_embeddings": 4096,
        "model_type": "llada2_moe", "moe_intermediate_size": 16, "moe_router_enable_expert_bias": True,
        "n_group": 4, "norm_head": False, "norm_topk_prob": True, "num_attention_heads": 4, "num_experts": 8,
        "num_experts_per_tok": 2, "num_hidden_layers": 3, "num_key_value_heads": 2, "num_shared_experts": 1,
        "pad_token_id": 156892, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-6, "rope_scaling": None,
        "rope_theta": 600000.0, "routed_scaling_factor": 2.5, "score_function": "sigmoid",
        "tie_word_embeddings": False, "topk_group": 2, "torch_dtype": _DTYPE_NAMES[dtype],
        "transformers_version": "4.56.0", "use_bias": False,  # 5.1: released value probably false
        "use_cache": False, "use_qk_norm": True, "use_qkv_bias": False, "vocab_size": 157184,
    }
    return _apply_overrides(cfg, overrides)


def _swiglu_tensors(prefix: str, init: _Init, hidden: int, inter: int) -> dict[str, torch.Tensor]:
    return {prefix + "gate_proj.weight": init.matrix(inter, hidden),
            prefix + "up_proj.weight": init.matrix(inter, hidden),
            prefix + "down_proj.weight": init.matrix(hidden, inter)}


def llada2_tensors(cfg: dict[str, Any], init: _Init) -> dict[str, torch.Tensor]:
    """Names/shapes of families.md 5.2 (fused QKV rows [Q heads, K heads, V heads], per-expert layout)."""
    h, vocab, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    n_q, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    n_exp, moe_inter = cfg["num_experts"], cfg["moe_intermediate_size"]
    t: dict[str, torch.Tensor] = {"model.word_embeddings.weight": init.matrix(vocab, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = init.norm(h)
        t[p + "attention.query_key_value.weight"] = torch.cat(  # rows [Q | K | V]
            [init.matrix((n_q + n_kv) * hd, h, std=QK_STD), init.matrix(n_kv * hd, h)])
        if cfg["use_qkv_bias"]:
            t[p + "attention.query_key_value.bias"] = init.matrix((n_q + 2 * n_kv) * hd)
        if cfg["use_qk_norm"]:
            t[p + "attention.query_layernorm.weight"] = init.norm(hd)
            t[p + "attention.key_layernorm.weight"] = init.norm(hd)
        t[p + "attention.dense.weight"] = init.matrix(h, n_q * hd)
        if cfg.get("use_bias", True):  # class default is True (5.1)
            t[p + "attention.dense.bias"] = init.matrix(h)
        t[p + "post_attention_layernorm.weight"] = init.norm(h)
        if i < cfg["first_k_dense_replace"]:
            t.update(_swiglu_tensors(p + "mlp.", init, h, cfg["intermediate_size"]))
            continue
        t[p + "mlp.gate.weight"] = init.matrix(n_exp, h)
        if cfg["moe_router_enable_expert_bias"]:
            # sigmoid scores vary by ~0.03 around 0.5 here; a bias of the same size makes both the
            # router logits and the bias decide the selection
            t[p + "mlp.gate.expert_bias"] = torch.randn(n_exp, generator=init.gen) * 0.03
        for e in range(n_exp):
            t.update(_swiglu_tensors(p + f"mlp.experts.{e}.", init, h, moe_inter))
        if cfg["num_shared_experts"]:
            t.update(_swiglu_tensors(p + "mlp.shared_experts.", init, h, moe_inter * cfg["num_shared_experts"]))
    t["model.norm.weight"] = init.norm(h)
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = init.matrix(vocab, h)
    return t


def make_llada2(out_dir: Path, *, seed: int = 0, dtype: torch.dtype | str = torch.float32,
                sharded: bool = False, **overrides: Any) -> Path:
    out, dt = _prepare(out_dir, dtype)
    cfg = llada2_config(dt, **overrides)
    # 5.4: eos/pad 156892; the tokenizer's mask_token is not set (dllm adds `<|mask|>` when it is
    # missing), the mask id is the hard-coded 156895.
    tok_cfg = {"add_bos_token": False, "add_eos_token": False, "bos_token": None,
               "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>",
               "model_max_length": 32768, "pad_token": "<|endoftext|>",
               "additional_special_tokens": ["<role>", "</role>", "<|role_end|>"],
               "tokenizer_class": "PreTrainedTokenizerFast"}
    write_tokenizer(out, LLADA2_TOKENS, tok_cfg, _special_map(tok_cfg), chat_template=LLADA2_CHAT_TEMPLATE)
    return _finish(out, cfg, llada2_tensors(cfg, _Init(seed)), dt, sharded)


FAMILIES: dict[str, Callable[..., Path]] = {
    "llada": make_llada,
    "dream": make_dream,
    "sdar": make_sdar,
    "fast_dllm_v2": make_fast_dllm_v2,
    "llada2": make_llada2,
}

# Real ids per family, for tests: mask token (string, id), eos id(s).
MASK_TOKENS: dict[str, tuple[str, int]] = {
    "llada": ("<|mdm_mask|>", 126336), "dream": ("<|mask|>", 151666), "sdar": ("<|MASK|>", 151669),
    "fast_dllm_v2": ("|<MASK>|", 151665), "llada2": ("<|mask|>", 156895),
}
