"""Write the AR twin (a transformers Qwen3ForCausalLM directory) as a GGUF file for llama.cpp.

    python bench/benchlib/gguf_export.py runs/ar-twin/model runs/ar-twin/model/twin-f32.gguf [--dtype f16]

Uses the `gguf` package (llama.cpp's own GGUF writer, on PyPI) for the file format and its tensor-name map
for Qwen3; llama.cpp's convert_hf_to_gguf.py does the same for released models, but it refuses a BPE
tokenizer whose pre-tokenizer hash it does not know, which ours is. The pre-tokenizer is recorded as
"default": the bench feeds llama.cpp token ids, never text, so only the vocabulary and merges matter
(for detokenizing), not how llama.cpp would split text. Qwen3 uses NeoX rotary in llama.cpp, the layout
of transformers' weights, so no q/k permutation is needed (Llama would need one).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def export(model_dir: Path, out: Path, dtype: str = "f32") -> Path:
    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("model_type") != "qwen3":
        raise SystemExit(f"{model_dir}: model_type {cfg.get('model_type')!r}, this writer handles qwen3 only")
    arch = gguf.MODEL_ARCH.QWEN3
    n_layers = int(cfg["num_hidden_layers"])
    names = gguf.get_tensor_name_map(arch, n_layers)
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16}[dtype]
    rope = cfg.get("rope_parameters") or {}
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    w = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(model_dir.name)
    w.add_context_length(int(cfg["max_position_embeddings"]))
    w.add_embedding_length(int(cfg["hidden_size"]))
    w.add_block_count(n_layers)
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(int(cfg["num_attention_heads"]))
    w.add_head_count_kv(int(cfg["num_key_value_heads"]))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_file_type(ftype)

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    vocab = tok.get_vocab()
    n_vocab = int(cfg["vocab_size"])
    by_id = {i: t for t, i in vocab.items()}
    added = {i: t for i, t in tok.added_tokens_decoder.items()}
    tokens, types = [], []
    for i in range(n_vocab):
        if i in added:
            tokens.append(added[i].content)
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
        else:  # rows of the embedding past the tokenizer's vocabulary
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=n_vocab)
    special.add_to_gguf(w)

    state = load_file(str(model_dir / "model.safetensors"))
    for name, t in state.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue  # llama.cpp reuses token_embd for the output when output.weight is absent
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise SystemExit(f"{model_dir}: no GGUF name for tensor {name}")
        arr = t.astype(np.float32)
        if dtype == "f16" and arr.ndim == 2:  # norms stay float32, as llama.cpp's converter keeps them
            arr = arr.astype(np.float16)
        w.add_tensor(gname, arr)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtype", choices=("f32", "f16"), default="f32")
    args = ap.parse_args()
    print(export(args.model, args.out, args.dtype))


if __name__ == "__main__":
    main()
