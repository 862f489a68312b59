"""The model a training run updates: a fresh unmask model, or any family's checkpoint, plus LoRA.

Weights are always held in the canonical (Qwen) layout of `DiffusionTransformer`; the family
only matters when reading and writing checkpoint names.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from unmask.errors import ModelLoadError, UnmaskError
from unmask.models.loader import load_spec, load_weights, read_state, weight_files
from unmask.models.registry import Family, family_for
from unmask.models.transformer import ArchConfig, DiffusionTransformer

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class TrainConfigError(UnmaskError, ValueError):
    """Training settings that contradict each other or the machine (re-exported by `unmask.train.trainer`)."""


@dataclass(frozen=True)
class ModelShape:
    """Size of a fresh unmask model: the shape of the 5.25M unmask-tiny built in until 2026-12-04 (now
    bench/models/unmask-tiny-5m), with untied embeddings by default (7.34M parameters; `unmask train` ties
    them, as that model does: 5.25M). The built-in model since is hidden 512 x 5 layers (scripts/device_train.py)."""

    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 32
    intermediate: int = 768
    max_position: int = 2048
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    block_size: int = 8  # default inference block size written to config.json

    def __post_init__(self):
        # checked here, before any tokenizing: a bad shape otherwise fails deep in model building (or, for
        # hidden 0, trained and exported a model without parameters)
        for name in ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "max_position",
                     "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TrainConfigError(f"model shape: {name} must be a positive integer, got {value!r}")
        if self.heads % self.kv_heads:
            raise TrainConfigError(f"model shape: heads {self.heads} must be a multiple of kv_heads {self.kv_heads} "
                                   "(each key/value head serves a whole group of query heads)")
        if self.head_dim % 2:
            raise TrainConfigError(f"model shape: head_dim must be even (rotary embeddings turn pairs of "
                                   f"dimensions), got {self.head_dim}")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise TrainConfigError(f"model shape: rope_theta must be a finite number > 0, got {self.rope_theta}")


def new_unmask_config(vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                      intermediate: int, max_pos: int, block_size: int, mask_id: int, eos_ids: list[int],
                      bos_id: int | None = None, pad_id: int | None = None, rope_theta: float = 10000.0,
                      tie_embeddings: bool = False, train_block_sizes: list[int] | None = None) -> dict:
    """config.json of an `UnmaskForDiffusionLM` (Qwen3 keys + mask_token_id + block_size)."""
    cfg = {
        "architectures": ["UnmaskForDiffusionLM"],
        "model_type": "unmask",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": tie_embeddings,
        "mask_token_id": mask_id,
        "block_size": block_size,
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else list(eos_ids),
        "bos_token_id": bos_id,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
        "use_cache": False,
    }
    if train_block_sizes:
        cfg["train_block_sizes"] = list(train_block_sizes)
    return cfg


def shape_config(shape: ModelShape, vocab_size: int, mask_id: int, eos_ids: list[int], bos_id: int | None,
                 pad_id: int | None, train_block_sizes: list[int] | None) -> dict:
    return new_unmask_config(vocab_size, shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.head_dim,
                             shape.intermediate, shape.max_position, shape.block_size, mask_id, eos_ids,
                             bos_id, pad_id, shape.rope_theta, shape.tie_embeddings, train_block_sizes)


def init_weights(model: DiffusionTransformer, seed: int, std: float = 0.02) -> None:
    """N(0, std) matrices and embeddings, unit norms; the projections that write into the
    residual stream get std / sqrt(2 * layers) so its variance does not grow with depth (GPT-2)."""
    g = torch.Generator().manual_seed(seed)
    resid_std = std / math.sqrt(2 * model.cfg.num_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():  # named_parameters: a tied weight appears once
            if p.dim() == 1:
                p.fill_(0.0 if name.endswith("bias") else 1.0)
            else:
                s = resid_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                p.copy_(torch.randn(p.shape, generator=g) * s)


@dataclass
class TrainableModel:
    model: DiffusionTransformer
    family: Family
    arch: ArchConfig
    config: dict                 # config.json to export
    generation_config: dict
    mask_id: int
    eos_id: int
    block_size: int              # the family's configured inference block size
    stop_ids: tuple[int, ...] = ()
    source: Path | None = None   # checkpoint directory it came from (files to carry on export)
    lora: dict = field(default_factory=dict)  # LoRA settings when adapters are injected


def fresh_model(config: dict, generation_config: dict, seed: int) -> TrainableModel:
    family = family_for(config)
    arch = family.parse_config(config)
    model = DiffusionTransformer(arch)
    init_weights(model, seed)
    eos = config["eos_token_id"]
    stops = generation_config.get("eos_token_id", eos)
    return TrainableModel(model, family, arch, config, generation_config, family.mask_id(config),
                          eos[0] if isinstance(eos, list) else eos, family.block_size(config),
                          tuple(stops if isinstance(stops, list) else [stops]))


def load_trainable(model_dir: str | Path) -> TrainableModel:
    """A checkpoint of any supported family, in float32 with gradients (load_model freezes)."""
    spec = load_spec(model_dir)
    if spec.family.model_class is not None or not isinstance(spec.arch, ArchConfig):  # its own network class
        raise TrainConfigError(f"{spec.path}: {spec.family.name} models cannot be trained by unmask (inference "
                               "only); the trainer takes unmask, LLaDA, Dream, SDAR, Fast-dLLM v2 and LLaDA2 models")
    model = DiffusionTransformer(spec.arch)
    load_weights(model, spec, read_state(weight_files(spec.path)))
    model = model.float().requires_grad_(True)
    if spec.eos_id is None:
        raise ModelLoadError(f"{spec.path}: no eos_token_id in config.json or generation_config.json")
    return TrainableModel(model, spec.family, spec.arch, dict(spec.config), dict(spec.generation_config),
                          spec.mask_id, spec.eos_id, spec.block_size, spec.stop_ids, source=spec.path)


def apply_lora(tm: TrainableModel, rank: int, alpha: float | None = None, dropout: float = 0.0) -> None:
    """Inject LoRA adapters (peft, arXiv 2106.09685) into attention and MLP linears; only they train."""
    from peft import LoraConfig, inject_adapter_in_model

    alpha = float(alpha if alpha is not None else 2 * rank)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(LORA_TARGETS))
    inject_adapter_in_model(cfg, tm.model)
    for name, p in tm.model.named_parameters():
        p.requires_grad_("lora_" in name)
    tm.lora = {"r": rank, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": list(LORA_TARGETS)}


def apply_draft_adapter(tm: TrainableModel, rank: int, alpha: float | None = None, seed: int = 0) -> None:
    """Give the model a draft adapter (models/draft_adapter.py) unless it has one, and freeze everything else:
    only masked rows change, so the next-token rows, and speculative decoding's output, stay the base's. A model
    that already has one keeps its own rank and goes on training it."""
    from dataclasses import replace

    from unmask.models.draft_adapter import DraftAdapterConfig

    if tm.family.attention != "block_causal":
        raise TrainConfigError(f"a draft adapter drafts for speculative decoding of block-causal models; "
                               f"{tm.family.name} is {tm.family.attention}")
    if tm.model.draft_gate is None:
        adapter = DraftAdapterConfig(rank, float(alpha if alpha is not None else 2 * rank), tm.mask_id)
        tm.model.enable_draft_adapter(adapter)
        g = torch.Generator().manual_seed(seed)  # A from the run's seed, not the process's RNG: runs repeat
        with torch.no_grad():
            for name, p in tm.model.named_parameters():
                if name.endswith(".draft_a"):
                    bound = 1 / math.sqrt(p.shape[1])  # nn.Linear's (and LoRA's) kaiming-uniform bound
                    p.copy_(torch.rand(p.shape, generator=g) * 2 * bound - bound)
        tm.arch = tm.model.cfg = replace(tm.arch, draft_adapter=adapter)
        tm.config["draft_adapter"] = adapter.to_config()
    for name, p in tm.model.named_parameters():
        p.requires_grad_(name.endswith((".draft_a", ".draft_b")))


def frozen_fingerprint(model: nn.Module) -> str:
    """A short hash of the frozen weights (a LoRA run's base): names, shapes and a sample of each tensor's values,
    so a resume can tell it was given another base of the same shape without hashing gigabytes."""
    import hashlib

    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.requires_grad:
                continue
            flat = p.detach().reshape(-1)
            sample = torch.cat([flat[:64], flat[-64:]]).float().cpu()
            h.update(f"{name}:{tuple(p.shape)}".encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def canonical_state(model: nn.Module, arch: ArchConfig) -> dict[str, torch.Tensor]:
    """Full weights in canonical names, LoRA deltas merged in (W + B A * alpha / r)."""
    raw = model.state_dict()
    lora = any("lora_" in k for k in raw)
    if lora:  # peft only where there are adapters: a plain export needs no peft installed
        from peft.tuners.lora import LoraLayer

    state = {}
    with torch.no_grad():
        for k, v in raw.items():
            if "lora_" in k:
                continue
            state[k.replace(".base_layer.", ".")] = v.detach()
        for name, mod in model.named_modules() if lora else ():
            if isinstance(mod, LoraLayer):
                key = f"{name}.weight"
                state[key] = state[key] + mod.get_delta_weight("default").to(state[key].dtype)
    if arch.tie_embeddings:
        state.pop("lm_head.weight", None)
    return {k: v for k, v in state.items() if not k.startswith("rope.")}


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a training checkpoint stores of the model: the parameters being trained."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def count_params(model: nn.Module, trainable: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable)
