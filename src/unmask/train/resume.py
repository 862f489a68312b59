"""Whether a checkpoint in out_dir can be resumed by this run: the same data and noise settings, the same model."""
from __future__ import annotations

from dataclasses import asdict

from torch import nn

from unmask.models.registry import family_for
from unmask.train.checkpoint import CheckpointError
from unmask.train.config import TrainConfig
from unmask.train.model_init import TrainableModel, trainable_state

# settings a resumed run must share with the checkpoint for its batches and noise to line up; the model itself
# is compared by its architecture (check_resume), since `cfg.model` only describes a fresh model
RESUME_KEYS = ("seq_len", "batch_size", "seed", "block_sizes", "lora_rank", "draft_adapter_rank", "sft_pack", "mix_fraction", "objective",
               "causal_context", "next_token_weight", "suffix_fraction", "confidence_weight", "full_block_fraction",
               "corrupt_fraction", "anchor_weight", "long_documents", "passkey_fraction", "rope_scaling",
               "position_span")


def check_resume(saved: dict, cfg: TrainConfig, tm: TrainableModel, model: nn.Module,
                 block_sizes: tuple[int, ...] | None) -> None:
    """Refuse, in one line, a checkpoint that this run's settings or model do not match. `block_sizes`: the
    sizes this run trains with, which block_sizes None (the default) stands for on either side."""
    now, defaults = asdict(cfg), asdict(TrainConfig())
    config = saved.get("config", {})

    def value(k: str, v):
        return _norm(block_sizes if k == "block_sizes" and v is None else v)

    # a key missing from an older checkpoint had its default value then
    diff = [k for k in RESUME_KEYS if value(k, config.get(k, defaults[k])) != value(k, now.get(k))]
    if diff:
        raise CheckpointError(f"cannot resume: {', '.join(f'{k} was {config.get(k)!r}, now {now.get(k)!r}' for k in diff)}")
    # the model being trained (a fresh one, --init-from or the fine-tuned checkpoint), not cfg.model
    saved_arch = _arch_of(saved.get("model_config"))
    if saved_arch is not None:
        ours = asdict(tm.arch)
        diff = [k for k, v in asdict(saved_arch).items() if v != ours.get(k)]
        if diff:
            raise CheckpointError("cannot resume: the checkpoint is of another model shape ("
                                  + ", ".join(f"{k} was {getattr(saved_arch, k)!r}, now {ours.get(k)!r}" for k in diff)
                                  + ")")
    mine = trainable_state(model)
    missing = set(mine) - set(saved["model"])
    if missing:
        raise CheckpointError(f"checkpoint lacks trained weights {sorted(missing)[:3]}")
    for name, p in mine.items():  # a last guard: load_state_dict would raise a multi-line size mismatch
        if tuple(saved["model"][name].shape) != tuple(p.shape):
            raise CheckpointError(f"cannot resume: checkpoint weight {name} has shape "
                                  f"{list(saved['model'][name].shape)}, the model's is {list(p.shape)}")


def _arch_of(model_config) -> object | None:
    """The ArchConfig a checkpoint's model_config describes, or None if it cannot be read."""
    if not isinstance(model_config, dict):
        return None
    try:
        return family_for(model_config).parse_config(model_config)
    except Exception:  # an older or foreign record: the weight shapes are still compared
        return None


def _norm(v):
    return list(v) if isinstance(v, tuple) else v
