"""What a training run is asked to do (`TrainConfig`, checked on construction) and what it returns."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from torch import nn

from unmask.errors import UnmaskError
from unmask.train.model_init import ModelShape, TrainConfigError

DEFAULT_BLOCK_SIZES = (4, 8, 16, 32)


class TrainDivergedError(UnmaskError):
    """The training loss or the weights became non-finite (NaN or infinity)."""

ON_ERROR = ("raise", "skip")


@dataclass
class TrainConfig:
    out_dir: str = "runs/unmask"
    lr: float = 1e-3
    min_lr_ratio: float = 0.1          # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    total_steps: int = 2000
    batch_size: int = 16               # rows per optimizer step, over all processes
    grad_accum: int = 1                # micro-batches per optimizer step (per process)
    seq_len: int = 256
    block_sizes: tuple[int, ...] | None = None  # None: (4, 8, 16, 32) pre-training; the model's own when fine-tuning
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    eval_every: int = 200              # 0: never
    eval_batches: int = 8
    save_every: int = 200              # 0: only at the end
    log_every: int = 10
    seed: int = 0
    bf16: bool | None = None           # bf16 autocast (weights, optimizer stay float32); None: where native
    device: str = "auto"               # "cpu", "cuda", "auto"
    lora_rank: int = 0                 # >0: train LoRA adapters only (fine-tuning)
    lora_alpha: float | None = None    # default 2 * rank
    lora_merge: bool = True            # export merged full weights (the adapter is saved either way)
    # >0: train only a draft adapter of this rank (models/draft_adapter.py: low-rank weights on masked rows, the
    # base frozen, so speculative decoding's output stays the base's); alpha: lora_alpha, default 2 * rank
    draft_adapter_rank: int = 0
    resume: bool = False               # continue from out_dir/checkpoint.pt if it exists
    overwrite: bool = False            # start over in an out_dir that holds an earlier run (else refused)
    export_dtype: str = "auto"         # "auto": float32 for a fresh model, else the source checkpoint's dtype
    on_error: Literal["skip", "raise"] = "raise"  # malformed SFT lines
    sft_pack: bool = False             # several short SFT records per row (see sft.build_sft_rows)
    mix_fraction: float = 0.0          # fine-tuning: share of rows that are plain corpus text (loss on all tokens)
    progress: Literal["auto", "rich", "plain", "none"] = "auto"
    compile: bool = False              # torch.compile each transformer block (see compile_blocks)
    checkpoint_activations: bool = False  # recompute each block's forward in the backward (see checkpoint_blocks)
    # "causal": next-token pre-training under causal attention, exported with shift_logits so that
    # block-diffusion training continues from it (objectives.py); pre-training (`train`) only
    objective: Literal["diffusion", "causal"] = "diffusion"
    # block diffusion whose committed text is read causally (objectives.py, "Causal context"): `train` sets
    # it on a shifted model's config, fine-tuning follows the model's config; next_token_weight scores the
    # clean stream's next-token rows alongside (0: off)
    causal_context: bool = False
    next_token_weight: float = 1.0
    suffix_fraction: float = 0.0       # block diffusion: share of blocks masked as a tail (objectives.py)
    full_block_fraction: float = 0.0   # block diffusion: share of blocks masked whole (objectives.py)
    confidence_weight: float = 0.0     # certainty forcing: entropy of right masked predictions (objectives.py)
    corrupt_fraction: float = 0.0      # share of noised positions holding a random token, not the mask (corruption.py)
    # with a causal context: weight of KL(starting model || this one) on the clean stream's next-token rows, which
    # holds the verifier of speculative decoding (its output) near the model the run started from (objectives.py)
    anchor_weight: float = 0.0
    # long-context continued pre-training (long_context.py): rows packed one document per package, a share of
    # passkey retrieval rows, RoPE scaling "linear:F" / "yarn:F" written to the exported config.json
    long_documents: bool = False
    passkey_fraction: float = 0.0
    rope_scaling: str | None = None
    # PoSE: positions of each row spread over this many (objectives.skipped_positions; checked against the rows
    # and the model's context by the trainer, which knows both); 0: off
    position_span: int = 0
    model: ModelShape = field(default_factory=ModelShape)  # fresh pre-training model only

    def __post_init__(self):
        if isinstance(self.model, dict):
            self.model = ModelShape(**self.model)
        if self.block_sizes is not None:
            try:
                self.block_sizes = tuple(int(b) for b in self.block_sizes)
            except (TypeError, ValueError):
                raise TrainConfigError(f"block_sizes must be positive integers, got {self.block_sizes!r}") from None
            if not self.block_sizes or min(self.block_sizes) < 1:
                raise TrainConfigError(f"block_sizes must be positive integers, got {list(self.block_sizes)}")
        # nan passes `<= 0` and reaches AdamW (a traceback); inf trains to all-NaN weights
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise TrainConfigError(f"lr must be a finite number > 0, got {self.lr}")
        for name in ("total_steps", "batch_size", "grad_accum", "seq_len", "log_every", "eval_batches"):
            if getattr(self, name) <= 0:
                raise TrainConfigError(f"{name} must be positive, got {getattr(self, name)}")
        # negative values pass `step % n == 0` on every step: an eval or checkpoint each step
        if self.draft_adapter_rank and self.lora_rank:
            raise TrainConfigError("draft_adapter_rank and lora_rank both choose which weights train: set one")
        for name in ("warmup_steps", "eval_every", "save_every", "lora_rank", "draft_adapter_rank"):
            if getattr(self, name) < 0:
                raise TrainConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.on_error not in ON_ERROR:
            raise TrainConfigError(f"on_error must be one of {', '.join(ON_ERROR)}, got {self.on_error!r}")
        if self.resume and self.overwrite:
            raise TrainConfigError("resume continues the run in out_dir and overwrite starts it over: choose one")
        if not 0.0 <= self.passkey_fraction < 1.0:
            raise TrainConfigError(f"passkey_fraction must be in [0, 1), got {self.passkey_fraction}")
        if self.objective not in ("diffusion", "causal"):
            raise TrainConfigError(f"objective must be 'diffusion' or 'causal', got {self.objective!r}")
        for name in ("suffix_fraction", "full_block_fraction", "corrupt_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise TrainConfigError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.next_token_weight < 0:
            raise TrainConfigError(f"next_token_weight must be >= 0, got {self.next_token_weight}")
        for name in ("confidence_weight", "anchor_weight"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise TrainConfigError(f"{name} must be a finite number >= 0, got {getattr(self, name)}")
        if self.anchor_weight and self.draft_adapter_rank:
            raise TrainConfigError("anchor_weight holds the clean rows to the starting model; a draft adapter "
                                   "never changes them: set one")
        for name in ("confidence_weight", "corrupt_fraction"):
            if getattr(self, name) and self.objective == "causal":
                raise TrainConfigError(f"{name} acts on masked positions; objective 'causal' masks nothing")
        if self.causal_context and self.objective == "causal":
            raise TrainConfigError("causal_context is a block-diffusion setting; objective 'causal' is all causal")
        if not 0.0 <= self.mix_fraction < 1.0:
            raise TrainConfigError(f"mix_fraction must be in [0, 1), got {self.mix_fraction}")
        if self.batch_size % self.grad_accum:
            raise TrainConfigError(f"batch_size {self.batch_size} is not divisible by grad_accum {self.grad_accum}")


@dataclass
class TrainResult:
    out_dir: Path
    model_dir: Path | None             # exported Hugging Face-format directory (rank 0; None with an unmerged LoRA)
    steps: int
    losses: list[float]                # training loss of every step, from step 1
    eval_losses: list[tuple[int, float]]
    tokens_per_s: float                # data tokens (not the doubled input) per second of training
    model: nn.Module | None = None     # the trained model (canonical layout, LoRA layers if any)
