"""A run's out_dir and process group around the loop: refuse to replace an earlier run unasked, remove what a
run that failed before its first step created, and export the trained model (or LoRA adapter) at the end."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist

from unmask.train.checkpoint import CHECKPOINT, CheckpointError, ensure_writable, export_model, save_adapter
from unmask.train.config import TrainConfig
from unmask.train.model_init import TrainableModel, TrainConfigError
from unmask.train.processes import _Dist, _init_dist, _Reporter

# what an earlier run leaves in out_dir: a new run without resume or overwrite must not replace it
_RUN_FILES = (CHECKPOINT, "model", "adapter")


def earlier_run(out: Path) -> list[str]:
    return [f"{n}/" if (out / n).is_dir() else n for n in _RUN_FILES if (out / n).exists()]


def export_run(cfg: TrainConfig, tm: TrainableModel, out: Path, tokenizer_dir: Path | None,
               rep: _Reporter) -> Path | None:
    model_dir = None
    tm.model.eval()
    if tm.lora:
        save_adapter(tm, out / "adapter")
        rep.log(f"LoRA adapter saved to {out / 'adapter'}")
    if not tm.lora or cfg.lora_merge:
        dtype = cfg.export_dtype
        if dtype == "auto":
            src = tm.config.get("torch_dtype") if tm.source else None
            dtype = src if src in ("float32", "bfloat16", "float16") else "float32"
        model_dir = export_model(tm, out / "model", tokenizer_dir, dtype)
        rep.log(f"model exported to {model_dir} ({tm.family.name} format)")
    # what this run did not write is an earlier run's (an --overwrite): it does not describe these weights
    stale = out / ("model" if model_dir is None else "adapter")
    if stale.is_dir() and (model_dir is None or not tm.lora):
        shutil.rmtree(stale)
        rep.log(f"removed {stale}, left by the earlier run")
    tm.model.train()
    return model_dir


def prepare_run(cfg: TrainConfig) -> _Dist:
    out = Path(cfg.out_dir)
    ctx = _init_dist(cfg.device)
    try:  # every rank checks, so a failure never leaves the others waiting at a barrier
        earlier = earlier_run(out)
        # a rerun into the same out_dir would replace its checkpoint and model/ (the Hugging Face examples'
        # rule: an existing output directory needs an explicit choice)
        if earlier and not cfg.overwrite and not (cfg.resume and (out / CHECKPOINT).is_file()):
            held = f"{out} already holds {' and '.join(earlier)} from an earlier run"
            if CHECKPOINT in earlier:
                raise CheckpointError(f"{held}: --resume continues it, --overwrite starts over")
            raise CheckpointError(f"{held} but no {CHECKPOINT} to resume: --overwrite replaces it")
        ctx.created = _first_missing(out)
        ensure_writable(out)  # fail before tokenizing or building anything
        if cfg.batch_size % (cfg.grad_accum * ctx.world):
            raise TrainConfigError(f"batch_size {cfg.batch_size} must be divisible by grad_accum {cfg.grad_accum} "
                                   f"x {ctx.world} processes")
    except BaseException:
        finish_run(ctx, failed=True)
        raise
    return ctx


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of `path` that does not exist yet (what mkdir(parents=True) will create)."""
    missing = None
    for p in (path, *path.parents):
        if p.exists():
            break
        missing = p
    return missing


def finish_run(ctx: _Dist, failed: bool = False) -> None:
    # a run that fails before its first step leaves no folder it made itself (an empty out_dir, a token cache)
    if failed and ctx.created is not None and not ctx.started:
        shutil.rmtree(ctx.created, ignore_errors=True)
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()
