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


def _write_failure(e: BaseException, what: str) -> BaseException:
    """A failed write (disk full, quota, I/O error) as one CheckpointError line; anything else unchanged.
    torch.save reports a failed write as a RuntimeError, safetensors as a SafetensorError."""
    from safetensors import SafetensorError

    if not isinstance(e, (OSError, RuntimeError, SafetensorError)):
        return e
    cause: BaseException | None = e
    while cause is not None and not isinstance(cause, OSError):  # torch.save's RuntimeError wraps the OSError
        cause = cause.__cause__ or cause.__context__
    if cause is not None:
        return CheckpointError(f"cannot write {what}: {cause.strerror or cause}")
    lines = str(e).strip().splitlines()
    return CheckpointError(f"cannot write {what}: {lines[-1] if lines else type(e).__name__}")


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one
    except BaseException as e:
        tmp.unlink(missing_ok=True)  # no half-written temp file is left behind; `path` is untouched
        err = _write_failure(e, str(path))
        if err is e:
            raise
        raise err from None


def _write_dir(out_dir: Path, fill) -> Path:
    """Build a directory with `fill(tmp)` in a sibling temp directory, then swap it in for `out_dir`: a crash or a
    full disk leaves the old directory (or none), never half of one, and no temp directory behind."""
    tmp = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}")
    old = out_dir.with_name(f".{out_dir.name}.old{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        fill(tmp)
        if out_dir.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out_dir, old)  # kept until the new one is in place
        try:
            os.replace(tmp, out_dir)
        except BaseException:
            if old.exists() and not out_dir.exists():
                os.replace(old, out_dir)
            raise
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        err = _write_failure(e, str(out_dir))
        if err is e:
            raise
        raise err from None
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def clear_leftovers(out_dir: Path) -> list[str]:
    """Remove the temp files and folders that killed runs left in out_dir mid-write (`_atomic_write`, `_write_dir`;
    named by their pid, so no later run replaces them). A `model/` or `adapter/` killed between its two renames is
    first put back from its `.old` copy. Returns the names removed."""
    removed = []
    for name in (CHECKPOINT, "model", "adapter"):
        olds = sorted(out_dir.glob(f".{name}.old*"), key=lambda p: p.stat().st_mtime)
        if olds and olds[-1].is_dir() and not (out_dir / name).exists():
            os.replace(olds.pop(), out_dir / name)
        for p in [*olds, *out_dir.glob(f".{name}.tmp*")]:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            removed.append(p.name)
    return removed


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

    def fill(tmp: Path) -> None:
        for src in (tm.source, tokenizer_dir):  # tokenizer last: the trained-with tokenizer wins
            if src is None:
                continue
            for f in Path(src).iterdir():
                if (f.is_file() and f.name not in _WEIGHT_FILES and f.name not in _PROVENANCE_FILES
                        and not f.name.endswith((".safetensors", ".bin", ".pt"))):
                    shutil.copy2(f, tmp / f.name)
        _keep_ngram_table(tm.source, tmp)
        state = canonical_state(tm.model, tm.arch)
        named = tm.family.from_canonical(state, tm.arch)
        tensors = {k: v.to(_EXPORT_DTYPES[dtype]).contiguous().clone() for k, v in named.items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_json(tmp / "config.json", dict(tm.config, torch_dtype=dtype))
        _write_json(tmp / "generation_config.json", tm.generation_config)
        shutil.copymode(tmp / "config.json", tmp / "model.safetensors")  # safetensors writes it 0600

    return _write_dir(out_dir, fill)


def _keep_ngram_table(source: Path | None, out: Path) -> None:
    """The source checkpoint's n-gram draft table (decoding.ngram_drafts) goes with the export when the export's
    tokenizer is the one it was counted with (else the model would refuse it at load): drafts from it never change
    an answer, so a trained student keeps its base's. A table counted with the base's own continuations
    (`--own-prompts`) drafts what the base wrote; recounting it for the student drafts what the student writes."""
    from unmask.decoding.ngram_drafts import FILE, counted_with, tokenizer_digest

    table = Path(source) / FILE if source is not None else None
    if table is None or not table.is_file() or not (out / "tokenizer.json").is_file():
        return
    if counted_with(table) == tokenizer_digest(out / "tokenizer.json"):
        shutil.copy2(table, out / FILE)


def save_adapter(tm: TrainableModel, out_dir: Path) -> Path:
    """LoRA weights (peft naming over unmask's canonical module names) + adapter_config.json."""
    from peft import get_peft_model_state_dict

    state = {k: v.contiguous().clone() for k, v in get_peft_model_state_dict(tm.model).items()}

    def fill(tmp: Path) -> None:
        save_file(state, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        _write_json(tmp / "adapter_config.json", {
            "peft_type": "LORA", "task_type": None, "bias": "none", **tm.lora,
            "base_model_name_or_path": str(Path(tm.source).resolve()) if tm.source else None,
            "unmask_layout": "canonical (Qwen) module names of unmask.models.transformer",
        })
        shutil.copymode(tmp / "adapter_config.json", tmp / "adapter_model.safetensors")  # safetensors: 0600

    return _write_dir(out_dir, fill)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
