"""The autoregressive twin itself, for scripts/train_ar_twin.py: its shape (copied from the reference diffusion
model), the FLOP accounting per row that matches the two models' compute (formulas in train_ar_twin.py's
docstring), and building, loading, scoring and exporting the Qwen3ForCausalLM.

Imported by train_ar_twin.py, which puts src/ on sys.path first.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from unmask.models.loader import load_spec

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


# ---------------------------------------------------------------------------------------------- accounting

@dataclass(frozen=True)
class Shape:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    max_position: int
    rope_theta: float
    rms_eps: float
    tie: bool

    @property
    def body_params(self) -> int:
        d, h, kv, dh, i = self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate
        return self.layers * (d * h * dh + 2 * d * kv * dh + h * dh * d + 3 * d * i)


def diffusion_flops_per_row(s: Shape, seq_len: int, eligible: float, next_token: bool = False) -> float:
    n = 2 * seq_len
    head_rows = 0.5 * eligible + (eligible if next_token else 0.0)  # + every clean row's next-token loss
    return (6 * s.body_params * n + 6 * s.hidden * s.vocab * head_rows
            + 3 * s.layers * 4 * n * n * s.heads * s.head_dim)


def ar_flops_per_row(s: Shape, seq_len: int, eligible: float) -> float:
    return (6 * s.body_params * seq_len + 6 * s.hidden * s.vocab * eligible
            + 3 * s.layers * 4 * seq_len * seq_len * s.heads * s.head_dim / 2)


@dataclass
class Phase:
    name: str
    ref_steps: int
    ref_warmup: int
    lr: float
    batch: int
    seq_len: int
    eligible: float = 0.0      # loss-eligible tokens per row (mean over the phase's rows)
    next_token: bool = False   # the reference also scored its clean rows' next-token loss (causal context)
    ref_flops: float = 0.0
    twin_flops_per_step: float = 0.0
    steps: int = 0
    warmup: int = 0

    def plan(self, shape: Shape, budget: str) -> None:
        self.ref_flops = self.ref_steps * self.batch * diffusion_flops_per_row(shape, self.seq_len, self.eligible,
                                                                              self.next_token)
        self.twin_flops_per_step = self.batch * ar_flops_per_row(shape, self.seq_len, self.eligible)
        self.steps = (max(1, round(self.ref_flops / self.twin_flops_per_step)) if budget == "flops"
                      else self.ref_steps)
        self.warmup = round(self.ref_warmup * self.steps / self.ref_steps)


# ---------------------------------------------------------------------------------------------- model

def shape_from(ref_dir: Path) -> tuple[Shape, dict, dict]:
    spec = load_spec(ref_dir)
    a = spec.arch
    shape = Shape(a.vocab_size, a.hidden_size, a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim,
                  a.intermediate_size, a.max_position, a.rope_theta, a.rms_eps, a.tie_embeddings)
    return shape, spec.config, spec.generation_config


def build_twin(shape: Shape, ref_config: dict, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, max_position_embeddings=shape.max_position, rms_norm_eps=shape.rms_eps,
        rope_theta=shape.rope_theta, tie_word_embeddings=shape.tie, attention_bias=False, hidden_act="silu",
        bos_token_id=ref_config.get("bos_token_id"), eos_token_id=ref_config.get("eos_token_id"),
        pad_token_id=ref_config.get("pad_token_id"), use_cache=True,
    )
    model = Qwen3ForCausalLM(cfg)
    # unmask's init (train/model_init.init_weights): N(0, 0.02), residual writers / sqrt(2 layers), unit norms
    g = torch.Generator().manual_seed(seed)
    resid = 0.02 / math.sqrt(2 * shape.layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                std = resid if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def load_base(model, base_dir: Path) -> dict:
    """Load a causal base: one written by `unmask train --objective causal` (unmask format = Qwen3 names), or
    an earlier twin (OUT/pretrain/model, a Qwen3ForCausalLM) to continue it the way a staged recipe does."""
    from safetensors.torch import load_file

    cfg = json.loads((base_dir / "config.json").read_text())
    if not (cfg.get("shift_logits") or "Qwen3ForCausalLM" in cfg.get("architectures", ())):
        sys.exit(f"{base_dir}: not a causal base (config.json lacks \"shift_logits\": true and is no "
                 "Qwen3ForCausalLM; train one with `unmask train --objective causal`)")
    from unmask.models.loader import weight_files

    state = {}
    for f in weight_files(base_dir):   # not every .safetensors is weights (the n-gram draft table)
        state.update(load_file(f))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        sys.exit(f"{base_dir}: weights do not fit the twin (missing {missing[:3]}, unexpected {unexpected[:3]})")
    if "lm_head.weight" in missing and not model.config.tie_word_embeddings:
        sys.exit(f"{base_dir}: no lm_head.weight for an untied twin")
    return cfg


def loss_sum(model, ids: torch.Tensor, lm: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sum of next-token CE over positions j+1 with loss_mask[j+1]; only those rows reach the LM head."""
    hidden = model.model(input_ids=ids).last_hidden_state  # [B, L, D]
    b, j = lm[:, 1:].nonzero(as_tuple=True)
    logits = model.lm_head(hidden[b, j]).float()
    return F.cross_entropy(logits, ids[b, j + 1], reduction="sum"), int(b.numel())


def export(model, out: Path, tokenizer_dir: Path, generation_config: dict, meta: dict) -> Path:
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).is_file():
            shutil.copy2(tokenizer_dir / f, tmp / f)
    gen = {k: generation_config[k] for k in ("eos_token_id", "bos_token_id", "pad_token_id") if k in generation_config}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (tmp / "ar_twin.json").write_text(json.dumps(meta, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
