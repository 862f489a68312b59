"""Training checkpoints (atomic, exact resume) and export to a Hugging Face-format directory."""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from unmask.errors import UnmaskError
from unmask.train.model_init import TrainableModel, canonical_state

CHECKPOINT = "checkpoint.pt"
# A source model's own training record describes how that model was made, not the one exported from it.
_PROVENANCE_FILES = ("training.json",)
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json", "config.json", "generation_config.json")
_EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(UnmaskError):
    """A checkpoint cannot be written or does not match the run resuming from it."""


def ensure_writable(out_dir: Path) -> None:
    """Create out_dir and prove a file can be written there, before any training work."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(f"output directory {str(out_dir)!r} is not writable: {e.strerror or e}") from None


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out_dir: Path, state: dict) -> Path:
    path = out_dir / CHECKPOINT
    _atomic_write(path, lambda fh: torch.save(state, fh))
    return path


def load_checkpoint(out_dir: Path) -> dict | None:
    path = out_dir / CHECKPOINT
    if not path.is_file():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated or foreign file: say which
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from None


def export_model(tm: TrainableModel, out_dir: Path, tokenizer_dir: Path | None, dtype: str = "float32") -> Path:
    """Write weights in the family's own checkpoint names, config.json, generation_config.json,
    and the tokenizer (plus any other non-weight files of the source checkpoint).

    Built in a sibling temp directory and renamed into place, so a crash leaves no half export.
    """
    if dtype not in _EXPORT_DTYPES:
        raise CheckpointError(f"unknown export dtype {dtype!r}; choose one of {', '.join(_EXPORT_DTYPES)}")
    tmp = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for src in (tm.source, tokenizer_dir):  # tokenizer last: the trained-with tokenizer wins
        if src is None:
            continue
        for f in Path(src).iterdir():
            if (f.is_file() and f.name not in _WEIGHT_FILES and f.name not in _PROVENANCE_FILES
                    and not f.name.endswith((".safetensors", ".bin", ".pt"))):
                shutil.copy2(f, tmp / f.name)
    state = canonical_state(tm.model, tm.arch)
    named = tm.family.from_canonical(state, tm.arch)
    tensors = {k: v.to(_EXPORT_DTYPES[dtype]).contiguous().clone() for k, v in named.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = dict(tm.config, torch_dtype=dtype)
    _write_json(tmp / "config.json", config)
    _write_json(tmp / "generation_config.json", tm.generation_config)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def save_adapter(tm: TrainableModel, out_dir: Path) -> Path:
    """LoRA weights (peft naming over unmask's canonical module names) + adapter_config.json."""
    from peft import get_peft_model_state_dict

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous().clone() for k, v in get_peft_model_state_dict(tm.model).items()}
    save_file(state, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "adapter_config.json", {
        "peft_type": "LORA", "task_type": None, "bias": "none", **tm.lora,
        "base_model_name_or_path": str(tm.source) if tm.source else None,
        "unmask_layout": "canonical (Qwen) module names of unmask.models.transformer",
    })
    return out_dir


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
