"""DiffusionGemma's checkpoint format: config.json parsed into `GemmaArch` (transformers'
DiffusionGemmaTextConfig defaults for keys it leaves out) and the stored weight names mapped to and from the
model module's (unmask.models.diffusion_gemma), which keeps the layers."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from unmask.errors import UnsupportedModelError
from unmask.models.layers import activation
from unmask.models.registry import StateDict

SLIDING, FULL = "sliding_attention", "full_attention"

# transformers' DiffusionGemmaTextConfig defaults for keys a config.json may leave out
_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
_PER_LAYER_KEYS = {"head_dim", "num_key_value_heads"}


@dataclass(frozen=True)
class GemmaArch:
    """Parsed `config.json` of a DiffusionGemma checkpoint (text path only)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    layer_types: tuple[str, ...]
    head_dims: tuple[int, ...]            # per layer
    kv_heads: tuple[int, ...]             # per layer
    intermediate_size: int
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    sliding_window: int
    rope: dict = field(hash=False)         # layer type -> (rope_type, theta, partial_rotary_factor, factor)
    max_position: int = 131072
    rms_eps: float = 1e-6
    softcap: float | None = 30.0
    act: str = "gelu_pytorch_tanh"
    attention_bias: bool = False
    canvas_length: int = 256
    image_token_ids: tuple[int, ...] = ()  # boi / image / eoi ids: refused in prompts
    tie_embeddings: bool = True
    # fields the loader / engine read on every family's config
    partial_rotary: float = 1.0
    rope_scaling: dict | None = None

    @property
    def head_dim(self) -> int:
        return self.head_dims[0]

    @property
    def rope_theta(self) -> float:
        return float(self.rope[self.layer_types[0]][1])


def _default_layer_types(n: int) -> list[str]:
    # DiffusionGemmaTextConfig.__post_init__: five sliding layers per full one
    return [SLIDING if (i + 1) % 6 else FULL for i in range(n)]


def parse_diffusion_gemma(cfg: dict) -> GemmaArch:
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise UnsupportedModelError("DiffusionGemma config.json has no text_config")
    if cfg.get("tie_word_embeddings", True) is False or text.get("tie_word_embeddings", True) is False:
        raise UnsupportedModelError("DiffusionGemma with untied encoder/decoder weights (tie_word_embeddings: false) "
                                    "is not supported")
    if text.get("use_bidirectional_attention") == "all":
        raise UnsupportedModelError("DiffusionGemma with a fully bidirectional encoder "
                                    "(use_bidirectional_attention: 'all') is not supported")
    if not text.get("num_experts") or not text.get("top_k_experts"):
        raise UnsupportedModelError("DiffusionGemma without a mixture of experts (num_experts unset) is not supported")
    n = text["num_hidden_layers"]
    types = list(text.get("layer_types") or _default_layer_types(n))
    if len(types) != n:
        raise UnsupportedModelError(f"layer_types has {len(types)} entries for {n} layers")
    types[-1] = FULL  # the reference forces the last layer to full attention
    bad = sorted(set(types) - {SLIDING, FULL})
    if bad:
        raise UnsupportedModelError(f"DiffusionGemma layer type(s) {', '.join(bad)} not supported")

    heads = text["num_attention_heads"]
    head_dims = [text.get("head_dim") or text["hidden_size"] // heads] * n
    kv = [text.get("num_key_value_heads") or heads] * n
    per_layer = text.get("per_layer_config")
    if per_layer is None:  # the config class derives the full-layer overrides from init-only keys
        override = {"head_dim": text.get("global_head_dim", 512)}
        if text.get("num_global_key_value_heads") is not None and text.get("attention_k_eq_v", True):
            override["num_key_value_heads"] = text["num_global_key_value_heads"]
        per_layer = {i: override for i, t in enumerate(types) if t == FULL}
    for key, over in per_layer.items():
        i = int(key)
        extra = sorted(set(over) - _PER_LAYER_KEYS)
        if extra:
            raise UnsupportedModelError(f"DiffusionGemma per-layer override(s) {', '.join(extra)} (layer {i}) "
                                        "are not supported")
        head_dims[i] = over.get("head_dim", head_dims[i])
        kv[i] = over.get("num_key_value_heads", kv[i])
    for i in range(n):
        if heads % kv[i]:
            raise UnsupportedModelError(f"layer {i}: {heads} heads is not a multiple of {kv[i]} kv heads")

    rope_params = text.get("rope_parameters") or _DEFAULT_ROPE
    rope = {}
    for t in set(types):
        p = rope_params.get(t) or _DEFAULT_ROPE[t]
        kind = p.get("rope_type", "default")
        if kind not in ("default", "proportional"):
            raise UnsupportedModelError(f"DiffusionGemma rope_type {kind!r} ({t}) is not supported; "
                                        "supported: default, proportional")
        if kind == "default" and p.get("factor", 1.0) != 1.0:
            raise UnsupportedModelError("DiffusionGemma RoPE scaling factor on default RoPE is not supported")
        rope[t] = (kind, float(p["rope_theta"]), float(p.get("partial_rotary_factor", 1.0)),
                   float(p.get("factor", 1.0)))

    activation(text.get("hidden_activation", "gelu_pytorch_tanh"))  # raises on an unknown activation
    image_ids = tuple(int(cfg[k]) for k in ("boi_token_id", "image_token_id", "eoi_token_id")
                      if isinstance(cfg.get(k), int))
    softcap = text.get("final_logit_softcapping", 30.0)  # class attribute in the reference: often not serialised
    return GemmaArch(
        vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"],
        num_layers=n,
        num_heads=heads,
        layer_types=tuple(types),
        head_dims=tuple(head_dims),
        kv_heads=tuple(kv),
        intermediate_size=text["intermediate_size"],
        num_experts=text["num_experts"],
        top_k_experts=text["top_k_experts"],
        moe_intermediate_size=text["moe_intermediate_size"],
        sliding_window=text.get("sliding_window") or 512,
        rope=rope,
        max_position=text.get("max_position_embeddings", 131072),
        rms_eps=text.get("rms_norm_eps", 1e-6),
        softcap=float(softcap) if softcap else None,
        act=text.get("hidden_activation", "gelu_pytorch_tanh"),
        attention_bias=bool(text.get("attention_bias", False)),
        canvas_length=int(cfg.get("canvas_length") or 256),
        image_token_ids=image_ids,
    )


# ---------------------------------------------------------------------------------------- layers


# ---------------------------------------------------------------------------------------- checkpoint names

_DEC, _ENC = "model.decoder.", "model.encoder.language_model."
_ENC_SCALAR = re.compile(r"model\.encoder\.language_model\.layers\.(\d+)\.layer_scalar$")


def to_canonical_names(state: StateDict, arch: GemmaArch) -> StateDict:
    """Stored names -> this module's names.

    Text weights are stored once under `model.decoder.` (save_pretrained drops the tied encoder copies);
    a checkpoint that stores them under the encoder instead is read from there. The encoder's own
    `layer_scalar` buffers become `encoder_layer_scalar` (ones when absent, the reference's init value).
    Vision weights are left for `ignore_params`.
    """
    out: StateDict = {}
    for name, t in state.items():
        m = _ENC_SCALAR.match(name)
        if m:
            out[f"model.layers.{m.group(1)}.encoder_layer_scalar"] = t
        elif name.startswith(_DEC):
            out["model." + name[len(_DEC):]] = t
        elif name.startswith(_ENC):
            canon = "model." + name[len(_ENC):]
            if (_DEC + name[len(_ENC):]) not in state:
                out[canon] = t
        else:
            out[name] = t
    for i in range(arch.num_layers):
        key = f"model.layers.{i}.encoder_layer_scalar"
        if key not in out and f"model.layers.{i}.layer_scalar" in out:
            out[key] = torch.ones_like(out[f"model.layers.{i}.layer_scalar"])
    return out


def from_canonical_names(state: StateDict, arch: GemmaArch) -> StateDict:
    out: StateDict = {}
    for name, t in state.items():
        m = re.match(r"model\.layers\.(\d+)\.encoder_layer_scalar$", name)
        if m:
            out[f"{_ENC}layers.{m.group(1)}.layer_scalar"] = t
        elif name.startswith("model."):
            out[_DEC + name[len("model."):]] = t
        else:
            out[name] = t
    return out
