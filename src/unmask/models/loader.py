"""Load a local Hugging Face-format model directory. Never touches the network."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from safetensors import SafetensorError, safe_open

from unmask.errors import ModelLoadError, UnsupportedModelError
from unmask.models.cpu_linear import pack_linears
from unmask.models.registry import Family, family_for
from unmask.models.transformer import ArchConfig, DiffusionTransformer
from unmask.precision import bf16_is_fast
from unmask.tokenizer import read_json_object

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelSpec:
    """What the engine needs to know about a loaded model besides its weights."""

    path: Path
    family: Family
    arch: ArchConfig
    config: dict
    generation_config: dict
    mask_id: int
    block_size: int
    stop_ids: tuple[int, ...]
    eos_id: int | None
    name: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def shift(self) -> bool:
        return self.family.shifted(self.config)

    @property
    def causal_context(self) -> bool:
        return self.family.causal_context(self.config)

    @property
    def ar_first_token(self) -> bool:
        return self.family.first_token_from_commit(self.config)

    @property
    def max_context(self) -> int:
        return self.arch.max_position


def dtype_name(dtype: torch.dtype) -> str:
    """The name `--dtype` takes for a torch dtype (the inverse of DTYPES)."""
    return next((name for name, dt in DTYPES.items() if dt == dtype), str(dtype).removeprefix("torch."))


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """An explicit dtype wins, then UNMASK_DTYPE; "auto" (the default) is bfloat16 where the device computes
    it natively (CUDA, CPUs with AVX512-BF16 or AMX) and float32 elsewhere. A small-batch decode step reads
    every weight once and is bound by memory bandwidth, so bf16 weights run it faster where bf16 is native
    (docs/benchmarks.md); without native support each bf16 GEMM is converted in software and far slower."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        dtype = os.environ.get("UNMASK_DTYPE") or "auto"
    if dtype == "auto":
        return torch.bfloat16 if bf16_is_fast(device) else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str | None) -> str:
    """'auto' (or None): UNMASK_DEVICE when set, else cuda when available, else cpu; anything else as given."""
    if device in (None, "auto"):
        device = os.environ.get("UNMASK_DEVICE") or "auto"
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def check_device(device: str) -> None:
    """cpu or an available CUDA device; anything else is a one-line error, not a torch traceback."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise ModelLoadError(f"unknown device {device!r}; use auto, cpu or cuda[:N]") from None
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"device {device!r} requested but CUDA is not available")
    elif kind != "cpu":
        raise ModelLoadError(f"device {device!r} is not supported; use auto, cpu or cuda[:N]")


def model_directory(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        hint = " (unmask never downloads: pass a local directory)" if "/" in str(path) and not p.exists() else ""
        raise ModelLoadError(f"model directory {str(path)!r} not found{hint}")
    if not (p / "config.json").is_file():
        hint = f" (a training run's export is its model/ folder: {p / 'model'})" if (p / "model" / "config.json").is_file() \
            else ""
        raise ModelLoadError(f"{p} has no config.json{hint}")
    return p


def weight_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_json_object(index).get("weight_map", {}).values()))
        missing = [s for s in shards if not (root / s).is_file()]
        if missing:
            raise ModelLoadError(f"{root}: shard(s) listed in model.safetensors.index.json are missing: {', '.join(missing)}")
        return [root / s for s in shards]
    single = root / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(f"{root} has no model.safetensors or model.safetensors.index.json")


def read_state(files: list[Path]) -> dict[str, torch.Tensor]:
    state = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:  # memory-mapped
                for k in fh.keys():
                    state[k] = fh.get_tensor(k)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f"cannot read weights {f.name}: {e}") from None
    return state


def load_spec(path: str | Path) -> ModelSpec:
    root = model_directory(path)
    config = read_json_object(root / "config.json")
    family = family_for(config)
    try:
        arch = family.parse_config(config)
    except KeyError as e:
        raise ModelLoadError(f"{root / 'config.json'} lacks required key {e.args[0]!r} for family {family.name}") from None
    except (TypeError, ValueError, AttributeError) as e:  # e.g. "hidden_size": "256", or negative head counts
        raise ModelLoadError(f"{root / 'config.json'}: invalid {family.name} config: {e}") from None
    if family.causal_context(config) and not family.shifted(config):
        raise ModelLoadError(f"{root / 'config.json'}: {family.context_key!r} needs {family.shift_key!r}: true "
                             "(a causal context reads each next token from the row before it)")
    gen_path = root / "generation_config.json"
    gen = read_json_object(gen_path) if gen_path.is_file() else {}
    stops: list[int] = []
    for src in (gen.get("eos_token_id"), config.get("eos_token_id"), family.extra_stop_ids):
        for t in (src if isinstance(src, (list, tuple)) else [src]):
            if isinstance(t, int) and t not in stops and t < arch.vocab_size:
                stops.append(t)
    eos = gen.get("eos_token_id", config.get("eos_token_id"))
    eos = eos[0] if isinstance(eos, list) else eos
    return ModelSpec(
        path=root, family=family, arch=arch, config=config, generation_config=gen,
        mask_id=family.mask_id(config), block_size=family.block_size(config), stop_ids=tuple(stops),
        eos_id=eos if isinstance(eos, int) else (stops[0] if stops else None),
        name=config.get("_name_or_path") or root.name,
    )


def _owned(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A 64-byte-aligned copy: mmapped safetensors data sits at arbitrary offsets, and oneDNN's
    linear on a misaligned weight is ~200x slower (measured on a 32x32 weight: 1.85 ms vs 7 us)."""
    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
        return t.to(dtype)
    return t.clone()


def load_weights(model: DiffusionTransformer, spec: ModelSpec, state: dict[str, torch.Tensor],
                 dtype: torch.dtype | None = None) -> None:
    canon = {k: _owned(v, dtype) for k, v in spec.family.to_canonical(state, spec.arch).items()}
    expected = {k: v for k, v in model.state_dict().items()}
    if spec.arch.tie_embeddings:
        expected.pop("lm_head.weight", None)
        canon.pop("lm_head.weight", None)
    for k in expected:  # a router without learned bias (moe_router_enable_expert_bias: false)
        if k.endswith("expert_bias") and k not in canon:
            canon[k] = torch.zeros_like(expected[k], device="cpu")
    missing = sorted(set(expected) - set(canon))
    unexpected = sorted(set(canon) - set(expected))
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ModelLoadError(f"{spec.path}: missing weights {', '.join(missing[:3])}{more}")
    if unexpected:
        more = f" (+{len(unexpected) - 3} more)" if len(unexpected) > 3 else ""
        raise ModelLoadError(f"{spec.path}: unexpected weights {', '.join(unexpected[:3])}{more}")
    for k, t in expected.items():
        if tuple(canon[k].shape) != tuple(t.shape):
            raise ModelLoadError(f"{spec.path}: weight {k} has shape {tuple(canon[k].shape)}, "
                                 f"config implies {tuple(t.shape)}")
        if t.is_floating_point() and not canon[k].is_floating_point():
            raise ModelLoadError(f"{spec.path}: weight {k} is {str(canon[k].dtype).removeprefix('torch.')}, "
                                 "not a floating-point tensor")
    model.load_state_dict(canon, strict=False, assign=True)
    if spec.arch.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


@contextlib.contextmanager
def _skip_init():
    """Build modules without running their initialisers: on the meta device they compute nothing, but
    their first call imports torch._dynamo (about 1.7 s of every `unmask generate` start, measured)."""
    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}
    for cls in saved:
        cls.reset_parameters = lambda self: None
    try:
        yield
    finally:
        for cls, fn in saved.items():
            cls.reset_parameters = fn


def load_model(path: str | Path, dtype: str | torch.dtype | None = None,
               device: str = "cpu", packed_linears: bool = True) -> tuple[DiffusionTransformer, ModelSpec]:
    """An inference model (eval mode, no gradients) and its spec. packed_linears: on the CPU, run the linears
    through oneDNN on weights packed once (models/cpu_linear.py; UNMASK_ONEDNN_LINEAR=0 also turns it off)."""
    device = resolve_device(device)
    check_device(device)
    spec = load_spec(path)
    dt = resolve_dtype(dtype, device)
    try:
        with _skip_init(), torch.device("meta"):
            model = (spec.family.model_class or DiffusionTransformer)(spec.arch)
    except (RuntimeError, ValueError, TypeError) as e:  # a config whose shapes no module can take
        raise ModelLoadError(f"{spec.path / 'config.json'}: cannot build the {spec.family.name} network: {e}") from None
    state = read_state(weight_files(spec.path))
    load_weights(model, spec, state, dt)
    del state
    model = model.to(device=device, dtype=dt)
    for block in model.model.layers:
        bias = getattr(getattr(block.mlp, "gate", None), "expert_bias", None)
        if bias is not None and bias.is_meta:
            raise ModelLoadError(f"{spec.path}: MoE expert_bias missing from checkpoint")
    model.eval().requires_grad_(False)
    if packed_linears:
        pack_linears(model)
    return model, spec
