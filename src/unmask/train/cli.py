"""Training commands of the CLI: unmask train | finetune | distill | calibrate (registered by unmask.cli).

The trainer, torch and the data code load inside each command, so `unmask --help` stays fast."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from unmask.cli_util import check_output_file, fail, plain_warnings
from unmask.defaults import DEVICE_HELP, DTYPE_HELP


def _train_config(out: Path, steps: int, batch_size: int, seq_len: int, lr: float, warmup: int, resume: bool,
                  eval_every: int, save_every: int, seed: int, lora_rank: int = 0, block_sizes: str | None = None,
                  on_error: str = "raise", overwrite: bool = False, draft_adapter_rank: int = 0, eval_batches: int = 8,
                  **model):
    from unmask.train.model_init import ModelShape
    from unmask.train.trainer import TrainConfig

    sizes = None
    if block_sizes:  # checked here, before the out dir or the data are touched; "" keeps the default
        try:
            sizes = tuple(int(b) for b in block_sizes.split(","))
        except ValueError:
            fail(f"--block-sizes must be comma-separated positive integers, got {block_sizes!r}")
        if min(sizes) < 1:
            fail(f"--block-sizes must be comma-separated positive integers, got {block_sizes!r}")
    return TrainConfig(out_dir=str(out), total_steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr,
                       warmup_steps=warmup, resume=resume, overwrite=overwrite, eval_every=eval_every,
                       save_every=save_every, eval_batches=eval_batches, seed=seed, lora_rank=lora_rank,
                       block_sizes=sizes, on_error=on_error,
                       draft_adapter_rank=draft_adapter_rank, model=ModelShape(**model) if model else ModelShape())


def _mix_fraction(mix_text: Path | None, fraction: float) -> float:
    """--mix-fraction applies only with --mix-text; there it must leave room for both kinds of rows."""
    if mix_text is None:
        return 0.0
    if not 0.0 < fraction < 1.0:
        fail(f"--mix-fraction must be between 0 and 1 (exclusive), got {fraction}")
    return fraction


BF16_HELP = ("bf16 autocast (weights and optimizer stay float32). Default: on where the device computes bf16 natively "
             "(CUDA with bf16, CPUs with AVX512-BF16 or AMX); elsewhere it is many times slower than float32.")
CONTEXT_HELP = ("Block diffusion from a causal base (--init-from) whose committed text is read token-causally, as "
                "the base reads it; recorded in the model's config (\"causal_context\": true), which the engine "
                "and fine-tuning follow.")
SUFFIX_HELP = ("Share of blocks whose masked positions are the block's tail (a clean prefix, as decoding that "
               "commits left to right sees it) instead of an independent draw; block diffusion only.")
FULL_BLOCK_HELP = ("Share of blocks masked whole: the draft block of policy speculative sees nothing of itself "
                   "(docs/decoding.md); block diffusion only.")
CORRUPT_HELP = ("Share of the noised positions that hold a random token instead of the mask; the loss also covers "
                "them and the other filled positions, so the model learns to replace wrong tokens, as the edit rules "
                "(--edit-threshold) ask of it (docs/training.md).")
EVAL_BATCHES_HELP = ("Held-out batches per evaluation (--eval-every and the last step); fewer keep evaluations of "
                     "long rows short.")
NEXT_TOKEN_HELP = "With a causal context: weight of the next-token loss on the clean rows (0: off)."
ANCHOR_HELP = ("With a causal context: weight of the KL divergence from the starting model's next-token predictions "
               "to the model's on the clean rows, which holds policy speculative's output near the starting model's "
               "(0: off; docs/training.md, 'Holding the verifier').")
LONG_DOCUMENTS_HELP = ("Long-context training: pack the corpus one document per package (its files in path order under "
                       "'# file: PATH' lines) instead of one per file (docs/training.md, 'Long context').")
PASSKEY_HELP = ("Long-context training: share of rows that bury a PASSKEY = \"NNNNN\" line in training text and end "
                "asking for it, the loss on the value only (the task of unmask eval --needle).")
ROPE_SCALING_HELP = ("Long-context training: linear:F (position interpolation) or yarn:F, written to config.json as "
                     "rope_scaling; the context becomes F x the one trained without scaling.")
POSITION_SPAN_HELP = ("Long-context training by PoSE (arXiv 2309.10400): each row's positions are cut at a random "
                      "point and the rest shifted by a random skip, so rows of --seq-len tokens train distances up "
                      "to N positions (within the model's context, after --rope-scaling). 0: off.")
CHECKPOINT_HELP = ("Activation checkpointing: each transformer block's forward runs again in the backward instead of "
                   "keeping its activations, for long rows that would not fit in memory (one 8K row of the built-in "
                   "model: peak memory 1.6 GB instead of 4.4 GB, the step ~1.05x as long; docs/training.md).")
COMPILE_HELP = ("torch.compile each transformer block: 1.2-1.5x faster steps measured on CPU, after ~45 s of "
                "compiling (needs a C++ compiler).")


def train(
    data: Path = typer.Option(Path("data/corpus"), help="Corpus directory (train.jsonl [+ heldout.jsonl])."),
    tokenizer: Optional[Path] = typer.Option(None, help="Tokenizer directory (default: data/tokenizer; with "
                                             "--init-from, that model's own)."),
    out: Path = typer.Option(Path("runs/pretrain"), help="Run directory (checkpoints, final model in out/model)."),
    steps: int = typer.Option(2000), batch_size: int = typer.Option(16), seq_len: int = typer.Option(512),
    lr: float = typer.Option(1e-3), warmup: int = typer.Option(100), seed: int = typer.Option(0),
    hidden: int = typer.Option(256), layers: int = typer.Option(4), heads: int = typer.Option(8),
    kv_heads: int = typer.Option(4), head_dim: int = typer.Option(32), intermediate: int = typer.Option(768),
    tie_embeddings: bool = typer.Option(True), block_sizes: Optional[str] = typer.Option(None, help="e.g. 4,8,16,32"),
    eval_every: int = typer.Option(200), save_every: int = typer.Option(100),
    eval_batches: int = typer.Option(8, help=EVAL_BATCHES_HELP),
    init_from: Optional[Path] = typer.Option(None, help="Continue pre-training from a model directory."),
    resume: bool = typer.Option(False, help="Continue a killed run from out/checkpoint.pt."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Start over in an --out that holds an earlier run "
                                   "(its checkpoint and model/ are replaced); without it or --resume that is refused."),
    compile: bool = typer.Option(False, "--compile", help=COMPILE_HELP),
    checkpoint_activations: bool = typer.Option(False, "--checkpoint-activations", help=CHECKPOINT_HELP),
    bf16: Optional[bool] = typer.Option(None, "--bf16/--no-bf16", help=BF16_HELP, show_default=False),
    objective: str = typer.Option("diffusion", help="diffusion | causal: next-token training of the same network, "
                                  "the base that block diffusion continues from (--init-from) with shifted logits."),
    causal_context: bool = typer.Option(False, "--causal-context", help=CONTEXT_HELP),
    next_token_weight: float = typer.Option(1.0, min=0.0, help=NEXT_TOKEN_HELP),
    suffix_fraction: float = typer.Option(0.0, min=0.0, max=1.0, help=SUFFIX_HELP),
    full_block_fraction: float = typer.Option(0.0, min=0.0, max=1.0, help=FULL_BLOCK_HELP),
    corrupt_fraction: float = typer.Option(0.0, min=0.0, max=1.0, help=CORRUPT_HELP),
    long_documents: bool = typer.Option(False, "--long-documents", help=LONG_DOCUMENTS_HELP),
    passkey_fraction: float = typer.Option(0.0, min=0.0, max=0.99, help=PASSKEY_HELP),
    rope_scaling: Optional[str] = typer.Option(None, help=ROPE_SCALING_HELP),
    position_span: int = typer.Option(0, min=0, help=POSITION_SPAN_HELP),
):
    """Pre-train a masked block-diffusion model from scratch (multi-process: launch with torchrun)."""
    from unmask.errors import UnmaskError
    from unmask.train.trainer import train as run_train

    try:
        cfg = _train_config(out, steps, batch_size, seq_len, lr, warmup, resume, eval_every, save_every, seed,
                            eval_batches=eval_batches,
                            block_sizes=block_sizes, overwrite=overwrite, hidden=hidden, layers=layers, heads=heads,
                            kv_heads=kv_heads, head_dim=head_dim, intermediate=intermediate,
                            tie_embeddings=tie_embeddings)
        cfg.compile, cfg.bf16 = compile, bf16
        cfg.checkpoint_activations = checkpoint_activations
        if objective not in ("diffusion", "causal"):
            fail(f"--objective must be diffusion or causal, got {objective!r}")
        cfg.objective = objective
        cfg.causal_context, cfg.next_token_weight = causal_context, next_token_weight
        cfg.suffix_fraction, cfg.full_block_fraction = suffix_fraction, full_block_fraction
        cfg.corrupt_fraction = corrupt_fraction
        cfg.long_documents, cfg.passkey_fraction, cfg.rope_scaling = long_documents, passkey_fraction, rope_scaling
        cfg.position_span = position_span
        if tokenizer is None:
            tokenizer = init_from if init_from is not None and (init_from / "tokenizer.json").is_file() \
                else Path("data/tokenizer")
        with plain_warnings():
            res = run_train(cfg, data, tokenizer, init_from=init_from)
    except UnmaskError as e:
        fail(str(e))
    typer.echo(f"done: {res.steps} steps, final model in {res.model_dir}")


def finetune(
    model: Path = typer.Option(..., "--model", "-m", help="Model directory to fine-tune (any supported family)."),
    data: Path = typer.Option(..., help="Chat JSONL: {\"messages\": [...]} (optionally \"tools\") or {\"fim\": {...}}."),
    out: Path = typer.Option(Path("runs/finetune")), eval_data: Optional[Path] = typer.Option(None),
    steps: int = typer.Option(500), batch_size: int = typer.Option(16), seq_len: int = typer.Option(512),
    lr: float = typer.Option(3e-4), warmup: int = typer.Option(50), seed: int = typer.Option(0),
    lora_rank: int = typer.Option(0, help=">0 trains LoRA adapters of this rank (peft) instead of all weights."),
    draft_adapter: int = typer.Option(0, help=">0 trains only a draft adapter of this rank: low-rank weights used "
                                      "by masked rows alone, so speculative decoding keeps the base's output "
                                      "(docs/training.md, \"A draft adapter\")."),
    block_sizes: Optional[str] = typer.Option(None), eval_every: int = typer.Option(100),
    eval_batches: int = typer.Option(8, help=EVAL_BATCHES_HELP),
    save_every: int = typer.Option(100), on_error: str = typer.Option("raise", help="Malformed JSONL lines: raise | skip."),
    pack: bool = typer.Option(False, help="Pack several short records per row instead of padding each."),
    mix_text: Optional[Path] = typer.Option(None, help="Corpus of plain text to replay among the chat rows."),
    mix_fraction: float = typer.Option(0.25, help="Share of rows taken from --mix-text."),
    resume: bool = typer.Option(False, help="Continue a killed run from out/checkpoint.pt."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Start over in an --out that holds an earlier run "
                                   "(its checkpoint and model/ are replaced); without it or --resume that is refused."),
    compile: bool = typer.Option(False, "--compile", help=COMPILE_HELP),
    checkpoint_activations: bool = typer.Option(False, "--checkpoint-activations", help=CHECKPOINT_HELP),
    bf16: Optional[bool] = typer.Option(None, "--bf16/--no-bf16", help=BF16_HELP, show_default=False),
    next_token_weight: float = typer.Option(1.0, min=0.0, help=NEXT_TOKEN_HELP + " Models without one ignore it."),
    suffix_fraction: float = typer.Option(0.0, min=0.0, max=1.0, help=SUFFIX_HELP),
    full_block_fraction: float = typer.Option(0.0, min=0.0, max=1.0, help=FULL_BLOCK_HELP),
    corrupt_fraction: float = typer.Option(0.0, min=0.0, max=1.0, help=CORRUPT_HELP),
    anchor_weight: float = typer.Option(0.0, min=0.0, help=ANCHOR_HELP),
    long_documents: bool = typer.Option(False, "--long-documents", help="With --mix-text: the replayed rows are "
                                        "whole packages, as in `train --long-documents`, so a long-context model "
                                        "keeps its context (docs/training.md, 'Long context')."),
    passkey_fraction: float = typer.Option(0.0, min=0.0, max=0.99, help="With --mix-text: share of the replayed "
                                           "rows that are passkey retrieval rows, as in `train --passkey-fraction`."),
):
    """Supervised fine-tuning on chat JSONL (loss on assistant tokens only)."""
    from unmask.errors import UnmaskError
    from unmask.train.trainer import finetune as run_finetune

    try:
        cfg = _train_config(out, steps, batch_size, seq_len, lr, warmup, resume, eval_every, save_every, seed,
                            eval_batches=eval_batches,
                            lora_rank=lora_rank, block_sizes=block_sizes, on_error=on_error, overwrite=overwrite,
                            draft_adapter_rank=draft_adapter)
        cfg.sft_pack = pack
        cfg.compile, cfg.bf16 = compile, bf16
        cfg.checkpoint_activations = checkpoint_activations
        cfg.next_token_weight, cfg.suffix_fraction = next_token_weight, suffix_fraction
        cfg.full_block_fraction, cfg.corrupt_fraction = full_block_fraction, corrupt_fraction
        cfg.anchor_weight = anchor_weight
        cfg.mix_fraction = _mix_fraction(mix_text, mix_fraction)
        if (long_documents or passkey_fraction) and mix_text is None:
            fail("--long-documents and --passkey-fraction shape the rows --mix-text replays: give --mix-text too")
        cfg.long_documents, cfg.passkey_fraction = long_documents, passkey_fraction
        with plain_warnings():
            res = run_finetune(cfg, model, data, eval_path=eval_data, mix_text=mix_text)
    except UnmaskError as e:
        fail(str(e))
    typer.echo(f"done: {res.steps} steps, final model in {res.model_dir}")


PROMPT_TEXT_HELP = ("Text corpus for prompts: a directory with train.jsonl, or a JSONL file of {\"text\": ...} "
                    "documents (cut at line ends).")
PROMPT_CHAT_HELP = "Chat / FIM JSONL (finetune's format) whose prompts are answered."


def distill(
    model: Path = typer.Option(..., "--model", "-m", help="Block-causal model to distil (unmask, SDAR, Fast-dLLM v2, "
                               "LLaDA2)."),
    text: Optional[Path] = typer.Option(None, help=PROMPT_TEXT_HELP),
    chat: Optional[Path] = typer.Option(None, help=PROMPT_CHAT_HELP),
    teacher: Optional[Path] = typer.Option(None, help="Teacher model (same tokenizer); default: the model itself."),
    out: Path = typer.Option(Path("runs/distill")),
    prompts: int = typer.Option(4096, help="Prompts the teacher answers (cached in out/trajectories)."),
    chat_fraction: float = typer.Option(0.25, help="Share of prompts from --chat when --text is given too."),
    answer_tokens: int = typer.Option(64, help="Longest teacher answer, in tokens."),
    teacher_policy: str = typer.Option("topk", help="The teacher's decoding policy (default topk with "
                                       "--teacher-tokens-per-step 1: one token per forward)."),
    teacher_tokens_per_step: int = typer.Option(1), teacher_threshold: float = typer.Option(0.9),
    teacher_block_size: Optional[int] = typer.Option(None, help="The teacher's block size (default: its own; 1 "
                                                     "with a causal-context model: its next-token decoding, what "
                                                     "policy speculative outputs)."),
    teacher_dtype: Optional[str] = typer.Option(None, help=DTYPE_HELP),
    confidence_weight: float = typer.Option(2.0, min=0.0, help="Certainty forcing: weight of the entropy of the "
                                            "masked predictions the model already gets right (0: plain distillation)."),
    steps: int = typer.Option(1000), batch_size: int = typer.Option(16), seq_len: int = typer.Option(256),
    lr: float = typer.Option(2e-4), warmup: int = typer.Option(50), seed: int = typer.Option(0),
    lora_rank: int = typer.Option(0, help=">0 trains LoRA adapters of this rank (peft) instead of all weights."),
    draft_adapter: int = typer.Option(0, help=">0 trains only a draft adapter of this rank: low-rank weights used "
                                      "by masked rows alone, so speculative decoding keeps the base's output "
                                      "(docs/training.md, \"A draft adapter\")."),
    block_sizes: Optional[str] = typer.Option(None), eval_every: int = typer.Option(100),
    eval_batches: int = typer.Option(8, help=EVAL_BATCHES_HELP),
    save_every: int = typer.Option(100),
    mix_text: Optional[Path] = typer.Option(None, help="Corpus of plain text to replay among the trajectory rows."),
    mix_fraction: float = typer.Option(0.25, help="Share of rows taken from --mix-text."),
    resume: bool = typer.Option(False, help="Continue a killed run (checkpoint and cached trajectories)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Start over in an --out that holds an earlier run."),
    compile: bool = typer.Option(False, "--compile", help=COMPILE_HELP),
    checkpoint_activations: bool = typer.Option(False, "--checkpoint-activations", help=CHECKPOINT_HELP),
    bf16: Optional[bool] = typer.Option(None, "--bf16/--no-bf16", help=BF16_HELP, show_default=False),
    next_token_weight: float = typer.Option(1.0, min=0.0, help=NEXT_TOKEN_HELP + " Models without one ignore it."),
    suffix_fraction: float = typer.Option(0.0, min=0.0, max=1.0, help=SUFFIX_HELP),
    full_block_fraction: float = typer.Option(0.0, min=0.0, max=1.0, help=FULL_BLOCK_HELP),
    corrupt_fraction: float = typer.Option(0.0, min=0.0, max=1.0, help=CORRUPT_HELP),
    anchor_weight: float = typer.Option(0.0, min=0.0, help=ANCHOR_HELP),
):
    """Distil a model for parallel decoding: train it on a teacher's answers (self-distillation by default) with
    certainty forcing, so it commits more tokens per forward (docs/training.md, "Distillation")."""
    from unmask.errors import UnmaskError
    from unmask.train.distill import distill as run_distill
    from unmask.train.trajectories import TrajectoryConfig

    if text is None and chat is None:
        fail("distill needs prompts: --text, --chat or both")
    try:
        traj = TrajectoryConfig(prompts=prompts, chat_fraction=chat_fraction, max_tokens=answer_tokens,
                                policy=teacher_policy, tokens_per_step=teacher_tokens_per_step,
                                threshold=teacher_threshold, block_size=teacher_block_size, seed=seed)
        traj.params()  # the policy and its settings are checked before the run starts
    except ValueError as e:
        fail(str(e))
    try:
        cfg = _train_config(out, steps, batch_size, seq_len, lr, warmup, resume, eval_every, save_every, seed,
                            eval_batches=eval_batches,
                            lora_rank=lora_rank, block_sizes=block_sizes, overwrite=overwrite,
                            draft_adapter_rank=draft_adapter)
        cfg.compile, cfg.bf16 = compile, bf16
        cfg.checkpoint_activations = checkpoint_activations
        cfg.confidence_weight, cfg.next_token_weight = confidence_weight, next_token_weight
        cfg.suffix_fraction, cfg.full_block_fraction = suffix_fraction, full_block_fraction
        cfg.corrupt_fraction, cfg.anchor_weight = corrupt_fraction, anchor_weight
        cfg.mix_fraction = _mix_fraction(mix_text, mix_fraction)
        with plain_warnings():
            res = run_distill(cfg, model, traj, text=text, chat=chat, teacher_dir=teacher, teacher_dtype=teacher_dtype,
                              mix_text=mix_text)
    except UnmaskError as e:
        fail(str(e))
    typer.echo(f"done: {res.steps} steps, final model in {res.model_dir}; compute in {out / 'distill.json'}")


def calibrate(
    model: Path = typer.Option(..., "--model", "-m", help="Block-causal model whose commit filter to fit (its "
                               "generation_config.json gets `commit_filter`)."),
    text: Optional[Path] = typer.Option(None, help=PROMPT_TEXT_HELP),
    chat: Optional[Path] = typer.Option(None, help=PROMPT_CHAT_HELP),
    prompts: int = typer.Option(128, help="Prompts the model answers one token per forward."),
    answer_tokens: int = typer.Option(64), block_size: Optional[int] = typer.Option(None),
    seed: int = typer.Option(0), device: str = typer.Option("auto", help=DEVICE_HELP),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the fit's statistics as JSON."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Fit and report, but leave the model's files as they are."),
):
    """Fit the learned commit rule (policy `learned`) to a model on its own one-token-per-forward decoding."""
    from unmask.errors import UnmaskError
    from unmask.train.calibrate import calibrate_model, write_filter

    if text is None and chat is None:
        fail("calibrate needs prompts: --text, --chat or both")
    check_output_file(json_out, "--json")
    try:
        flt, stats = calibrate_model(model, text, chat, prompts, answer_tokens, block=block_size, seed=seed,
                                     device=device)
    except (UnmaskError, ValueError) as e:
        fail(str(e))
    typer.echo(f"fit on {stats['rows']:,} masked positions: {stats['base_rate']:.1%} already final, log loss "
               f"{stats['log_loss']:.3f}, accuracy {stats['accuracy']:.1%}")
    c = stats["confidence_0.9"]
    typer.echo(f"confidence >= 0.9 commits {c['committed_share']:.1%} of them, {c['precision'] or 0:.1%} final")
    for row in stats["thresholds"]:
        typer.echo(f"learned, threshold {row['threshold']:.2f}: commits {row['committed_share']:.1%}, "
                   f"{row['precision'] or 0:.1%} final")
    if json_out is not None:
        json_out.write_text(json.dumps({**stats, "filter": flt.to_json()}, indent=2) + "\n")
    if not dry_run:
        typer.echo(f"wrote commit_filter to {write_filter(model, flt, stats)}")


def ngram_drafts(
    model: Path = typer.Option(..., "--model", "-m", help="Model whose tokenizer counts the text; the table is "
                               "written beside its weights (ngram_drafts.safetensors)."),
    text: Path = typer.Option(Path("data/corpus"), help="The model's training text: a corpus directory (its "
                              "train.jsonl) or a JSONL file of {\"text\": ...} documents. Never held-out text."),
    max_n: int = typer.Option(4, min=1, max=8, help="Longest context counted (at most what packs into 63 bits: 4 "
                              "for the built-in vocabulary, 3 for ~150K tokens)."),
    min_count: int = typer.Option(4, min=1, help="Keep a context only where its most frequent next token followed "
                                  "it at least this often."),
    out: Optional[Path] = typer.Option(None, help="Write here instead of beside the weights."),
    own_prompts: int = typer.Option(0, min=0, help="Also count the model's own greedy continuations (its default "
                                    "policy) of this many prompts cut from the text at line ends, so the drafts "
                                    "follow what the model writes (8192: minutes on a CPU; 0: the text alone)."),
    own_tokens: int = typer.Option(64, min=1, max=4096, help="Tokens of each own continuation."),
    seed: int = typer.Option(0, help="Seed of the prompts' choice."),
    dtype: Optional[str] = typer.Option(None, help="dtype the model runs in for its continuations (default: "
                                        "what it serves in)."),
):
    """Count a model's training text into the n-gram table that policy `speculative` drafts from (REST-style)."""
    from unmask.errors import UnmaskError
    from unmask.train.ngram_table import build_table

    check_output_file(out, "--out")
    try:
        path, table, seconds = build_table(model, text, max_n, min_count, out, own_prompts, own_tokens, seed, dtype,
                                           progress=own_prompts > 0)
    except (UnmaskError, OSError) as e:
        fail(str(e))
    own = (f" ({table.own_tokens:,} of them written by the model, continuing {own_prompts:,} prompts)"
           if own_prompts else "")
    typer.echo(f"counted {table.source_tokens:,} tokens{own} in {seconds:.1f} s: {len(table):,} contexts of 1-"
               f"{table.max_n} tokens (min count {min_count}); wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
