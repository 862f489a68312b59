"""Command line: unmask generate | chat | bench | corpus | train | finetune | distill | calibrate | eval | serve."""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Optional

import typer

from unmask.defaults import DEVICE_HELP, DTYPE_HELP

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Inference engine, trainer and server for diffusion language models.")


@app.callback()
def _root() -> None:
    """Inference engine, trainer and server for diffusion language models."""


def fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


@contextlib.contextmanager
def _plain_warnings():
    """Warnings (skipped records, ...) as `warning: …` lines on stderr, without Python's file:line and source line."""
    with warnings.catch_warnings():
        warnings.showwarning = lambda message, *_a, **_k: typer.echo(f"warning: {message}", err=True)
        yield


def _check_utf8(text: str, what: str) -> None:
    """Bytes that are not UTF-8 reach Python as lone surrogates, which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        fail(f"{what} is not valid UTF-8")


def _check_output_file(path: Path | None, flag: str) -> None:
    """Before a long run: a results file that cannot be written would lose its results at the end."""
    if path is None:
        return
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir() or not parent.is_dir() or not os.access(parent, os.W_OK):
        fail(f"{flag} {path} cannot be written (a directory, or its folder is missing or read-only)")


DRY_HELP = ("DRY loop penalty (llama.cpp's): penalise the token that would extend a repeat of an earlier "
            "run of tokens, multiplier * base^(length - allowed length); 0 = off (default: the model's "
            "generation_config). docs/decoding.md")


def _breakers(values: Optional[list[str]]) -> Optional[list[str]]:
    """--dry-sequence-breaker values: unset -> None (the default set), 'none' -> no breakers; a typed \\n or
    \\t is a newline or tab, as in llama.cpp's CLI."""
    if not values:
        return None
    if values == ["none"]:
        return []
    return [v.replace("\\n", "\n").replace("\\t", "\t") for v in values]


def _params(**kw):
    from unmask.engine.params import GenerationParams

    return GenerationParams(**{k: v for k, v in kw.items() if v is not None})


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="Prompt text (use --chat to wrap it in the chat template)."),
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="Model directory (default: built-in unmask-tiny)."),
    policy: str = typer.Option("threshold", help="Decoding policy (see docs/decoding.md)."),
    threshold: float = typer.Option(0.9, help="Confidence threshold for threshold/credit policies."),
    block_size: Optional[int] = typer.Option(None, help="Block size (default: the model's)."),
    steps: Optional[int] = typer.Option(None, help="Denoising steps per block for schedule-based policies."),
    tokens_per_step: Optional[int] = typer.Option(None, help="Fixed tokens per step for the topk policy."),
    factor: float = typer.Option(1.0, help="f of the factor policy (> 0; larger commits more per step)."),
    entropy_bound: Optional[float] = typer.Option(
        None, help="entropy_bounded policy's bound in nats, >= 0 (default 0.35); DiffusionGemma's acceptance bound."),
    small_block_size: Optional[int] = typer.Option(
        None, help="Fast-dLLM v2 sub-blocks: decode only the leftmost slice of this many tokens that has masks "
                   "(divides the block size; block-causal families)."),
    multi_block_threshold: Optional[float] = typer.Option(
        None, help="Start the next block once this share of the active one is committed (causal-context models)."),
    alg_temp: Optional[float] = typer.Option(
        None, help="Dream's policies: > 0 samples the rows to commit from softmax(confidence / alg_temp) (default 0)."),
    credit_decay: Optional[float] = typer.Option(None, help="credit policy: EMA decay in [0, 1] (default 0.8)."),
    credit_gamma: Optional[float] = typer.Option(None, help="credit policy: exponent on p_top1, > 0 (default 0.2)."),
    credit_weight: Optional[float] = typer.Option(None, help="credit policy: fusion weight, >= 0 (default 0.7)."),
    max_tokens: int = typer.Option(128, help="Maximum tokens to generate."),
    temperature: float = typer.Option(0.0, help="Sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(1.0), top_k: int = typer.Option(0),
    seed: Optional[int] = typer.Option(None, help="Seed for reproducible sampling."),
    presence_penalty: Optional[float] = typer.Option(
        None, help="Subtracted from tokens already in the output (-2..2; default: the model's generation_config)."),
    frequency_penalty: Optional[float] = typer.Option(
        None, help="Subtracted per earlier occurrence in the output (-2..2; default: the model's generation_config)."),
    repetition_penalty: Optional[float] = typer.Option(
        None, help="Divides positive (multiplies negative) logits of prompt and output tokens (1 = off; default: "
                   "the model's generation_config)."),
    dry_multiplier: Optional[float] = typer.Option(None, help=DRY_HELP),
    dry_base: Optional[float] = typer.Option(None, help="DRY: growth per repeated token (default 1.75)."),
    dry_allowed_length: Optional[int] = typer.Option(None, help="DRY: repeats this long go free (default 2)."),
    dry_penalty_last_n: Optional[int] = typer.Option(None, help="DRY: tokens of context searched (-1 = all)."),
    dry_sequence_breaker: Optional[list[str]] = typer.Option(
        None, help="DRY: text that ends a repeat (repeatable; default \\n : \" *; 'none' for no breakers)."),
    cache: str = typer.Option("auto", help="Bidirectional families: none | prefix | dual."),
    stop: list[str] = typer.Option([], help="Stop string (repeatable, up to 4)."),
    chat: bool = typer.Option(False, help="Render the prompt as one user turn with the chat template (and take the "
                                          "model's chat_defaults penalties, as a chat request would)."),
    stats: bool = typer.Option(False, help="Print tokens, forwards, tokens per forward and tokens/s."),
    dtype: Optional[str] = typer.Option(None, help=DTYPE_HELP),
    device: str = typer.Option("auto", help=DEVICE_HELP),
):
    """Generate text for one prompt and print it."""
    from unmask.engine.llm import LLM
    from unmask.errors import InvalidRequestError, UnmaskError

    try:
        knobs = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                     policy=policy, threshold=threshold, block_size=block_size, steps=steps,
                     tokens_per_step=tokens_per_step, factor=factor, entropy_bound=entropy_bound, alg_temp=alg_temp,
                     small_block_size=small_block_size, multi_block_threshold=multi_block_threshold,
                     credit_decay=credit_decay,
                     credit_gamma=credit_gamma, credit_weight=credit_weight, cache=cache, stop=list(stop),
                     presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                     repetition_penalty=repetition_penalty, dry_multiplier=dry_multiplier, dry_base=dry_base,
                     dry_allowed_length=dry_allowed_length, dry_penalty_last_n=dry_penalty_last_n,
                     dry_sequence_breakers=_breakers(dry_sequence_breaker))
        _params(**knobs)  # bad flags fail before the model loads
        _check_utf8(prompt, "the prompt")
        llm = LLM(model, dtype=dtype, device=device)
        params = _params(**_with_model_defaults(llm, knobs, chat=chat))  # --chat: a chat answer, as the server's
        ids = llm.chat_prompt([{"role": "user", "content": prompt}]) if chat else llm.encode(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        # stream the text as blocks commit (as `unmask chat` and llama.cpp's CLI do): the first words show
        # after one block, not after the whole answer
        if not chat:
            sys.stdout.write(prompt)
            sys.stdout.flush()
        t0, last = time.perf_counter(), None
        for last in llm.stream(ids, params):
            sys.stdout.write(last.text_delta)
            sys.stdout.flush()
        elapsed = time.perf_counter() - t0
    except UnmaskError as e:
        fail(str(e))
    typer.echo("")
    if stats and last is not None:
        n = last.num_generated
        typer.echo(f"[{n} tokens, {last.forwards} forwards, {n / max(last.forwards, 1):.2f} tokens/forward, "
                   f"{n / elapsed:.1f} tokens/s, finish={last.finish_reason}]", err=True)


@app.command()
def corpus(
    out: Path = typer.Option(Path("data/corpus"), help="Output directory for train/heldout JSONL."),
    tokenizer_out: Path = typer.Option(Path("data/tokenizer"), help="Where to write the trained tokenizer."),
    sft_out: Path = typer.Option(Path("data/sft"), help="Where to write the instruction data."),
    docs: bool = typer.Option(True, help="Include the Python documentation when installed."),
    packages: Optional[list[str]] = typer.Option(
        None, "--package", help="Also take the .py files of this installed package (repeatable; e.g. torch, "
        "which the Makefile pins) as pre-training text. The tokenizer, the instruction data and heldout.jsonl "
        "stay stdlib + docs only; the package's held-out files go to heldout-packages.jsonl."),
    seed: int = typer.Option(0),
):
    """Build the offline corpus, the BPE tokenizer and the instruction data (deterministic)."""
    from unmask.errors import UnmaskError
    from unmask.train.corpus import (build_corpus, check_output_dirs, collect_files, read_documents,
                                     resolve_packages, split_files, staged_dir)
    from unmask.train.instructions import build_instructions, first_user_prompt, write_jsonl
    from unmask.train.tokenizer import save_hf_tokenizer, train_tokenizer

    if out.resolve() == sft_out.resolve():  # both write train.jsonl and heldout.jsonl
        fail(f"--out and --sft-out are the same directory {out}: the instruction data would overwrite the corpus")
    try:
        # Everything that can be refused is, before the build (tens of seconds) rewrites any output.
        roots = resolve_packages(packages or ())
        check_output_dirs({"--out": out, "--tokenizer-out": tokenizer_out, "--sft-out": sft_out})
        stats = build_corpus(out, include_docs=docs, packages=list(roots), package_dirs=roots)
        typer.echo(f"corpus: {stats.train_files} train files ({stats.train_bytes / 1e6:.1f} MB), "
                   f"{stats.heldout_files} held out -> {out}")
        # The tokenizer never sees package text, so adding a package leaves every token id unchanged.
        tok = train_tokenizer(d.text for d in read_documents(out / "train.jsonl") if not d.source.startswith("pkg:"))
        with staged_dir(tokenizer_out) as staging:  # save_hf_tokenizer truncates in place; swap whole files in
            save_hf_tokenizer(tok, staging)
        typer.echo(f"tokenizer: {tok.get_vocab_size()} tokens -> {tokenizer_out}")
        train_files, held_files = split_files(collect_files(include_docs=docs))
        train_recs = build_instructions(train_files, seed, heldout=False)
        seen = {p for p in map(first_user_prompt, train_recs) if p}
        held_recs = build_instructions(held_files, seed, heldout=True, exclude_prompts=seen)
        sft_out.mkdir(parents=True, exist_ok=True)
        write_jsonl(train_recs, sft_out / "train.jsonl")
        write_jsonl(held_recs, sft_out / "heldout.jsonl")
    except (UnmaskError, ValueError) as exc:
        fail(str(exc))
    except OSError as exc:  # e.g. disk full: each output is replaced whole or not at all
        where = Path(exc.filename).parent if exc.filename else "the outputs"
        fail(f"cannot write {where}: {exc.strerror or exc}")
    typer.echo(f"instructions: {len(train_recs)} train, {len(held_recs)} held-out records -> {sft_out}")


def _train_config(out: Path, steps: int, batch_size: int, seq_len: int, lr: float, warmup: int, resume: bool,
                  eval_every: int, save_every: int, seed: int, lora_rank: int = 0, block_sizes: str | None = None,
                  on_error: str = "raise", overwrite: bool = False, **model):
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
                       save_every=save_every, seed=seed, lora_rank=lora_rank, block_sizes=sizes, on_error=on_error,
                       model=ModelShape(**model) if model else ModelShape())


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
NEXT_TOKEN_HELP = "With a causal context: weight of the next-token loss on the clean rows (0: off)."
COMPILE_HELP = ("torch.compile each transformer block: 1.2-1.5x faster steps measured on CPU, after ~45 s of "
                "compiling (needs a C++ compiler).")


@app.command()
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
    init_from: Optional[Path] = typer.Option(None, help="Continue pre-training from a model directory."),
    resume: bool = typer.Option(False, help="Continue a killed run from out/checkpoint.pt."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Start over in an --out that holds an earlier run "
                                   "(its checkpoint and model/ are replaced); without it or --resume that is refused."),
    compile: bool = typer.Option(False, "--compile", help=COMPILE_HELP),
    bf16: Optional[bool] = typer.Option(None, "--bf16/--no-bf16", help=BF16_HELP, show_default=False),
    objective: str = typer.Option("diffusion", help="diffusion | causal: next-token training of the same network, "
                                  "the base that block diffusion continues from (--init-from) with shifted logits."),
    causal_context: bool = typer.Option(False, "--causal-context", help=CONTEXT_HELP),
    next_token_weight: float = typer.Option(1.0, min=0.0, help=NEXT_TOKEN_HELP),
    suffix_fraction: float = typer.Option(0.0, min=0.0, max=1.0, help=SUFFIX_HELP),
):
    """Pre-train a masked block-diffusion model from scratch (multi-process: launch with torchrun)."""
    from unmask.errors import UnmaskError
    from unmask.train.trainer import train as run_train

    try:
        cfg = _train_config(out, steps, batch_size, seq_len, lr, warmup, resume, eval_every, save_every, seed,
                            block_sizes=block_sizes, overwrite=overwrite, hidden=hidden, layers=layers, heads=heads,
                            kv_heads=kv_heads, head_dim=head_dim, intermediate=intermediate,
                            tie_embeddings=tie_embeddings)
        cfg.compile, cfg.bf16 = compile, bf16
        if objective not in ("diffusion", "causal"):
            fail(f"--objective must be diffusion or causal, got {objective!r}")
        cfg.objective = objective
        cfg.causal_context, cfg.next_token_weight = causal_context, next_token_weight
        cfg.suffix_fraction = suffix_fraction
        if tokenizer is None:
            tokenizer = init_from if init_from is not None and (init_from / "tokenizer.json").is_file() \
                else Path("data/tokenizer")
        with _plain_warnings():
            res = run_train(cfg, data, tokenizer, init_from=init_from)
    except UnmaskError as e:
        fail(str(e))
    typer.echo(f"done: {res.steps} steps, final model in {res.model_dir}")


@app.command()
def finetune(
    model: Path = typer.Option(..., "--model", "-m", help="Model directory to fine-tune (any supported family)."),
    data: Path = typer.Option(..., help="Chat JSONL: {\"messages\": [...]} (optionally \"tools\") or {\"fim\": {...}}."),
    out: Path = typer.Option(Path("runs/finetune")), eval_data: Optional[Path] = typer.Option(None),
    steps: int = typer.Option(500), batch_size: int = typer.Option(16), seq_len: int = typer.Option(512),
    lr: float = typer.Option(3e-4), warmup: int = typer.Option(50), seed: int = typer.Option(0),
    lora_rank: int = typer.Option(0, help=">0 trains LoRA adapters of this rank (peft) instead of all weights."),
    block_sizes: Optional[str] = typer.Option(None), eval_every: int = typer.Option(100),
    save_every: int = typer.Option(100), on_error: str = typer.Option("raise", help="Malformed JSONL lines: raise | skip."),
    pack: bool = typer.Option(False, help="Pack several short records per row instead of padding each."),
    mix_text: Optional[Path] = typer.Option(None, help="Corpus of plain text to replay among the chat rows."),
    mix_fraction: float = typer.Option(0.25, help="Share of rows taken from --mix-text."),
    resume: bool = typer.Option(False, help="Continue a killed run from out/checkpoint.pt."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Start over in an --out that holds an earlier run "
                                   "(its checkpoint and model/ are replaced); without it or --resume that is refused."),
    compile: bool = typer.Option(False, "--compile", help=COMPILE_HELP),
    bf16: Optional[bool] = typer.Option(None, "--bf16/--no-bf16", help=BF16_HELP, show_default=False),
    next_token_weight: float = typer.Option(1.0, min=0.0, help=NEXT_TOKEN_HELP + " Models without one ignore it."),
    suffix_fraction: float = typer.Option(0.0, min=0.0, max=1.0, help=SUFFIX_HELP),
):
    """Supervised fine-tuning on chat JSONL (loss on assistant tokens only)."""
    from unmask.errors import UnmaskError
    from unmask.train.trainer import finetune as run_finetune

    try:
        cfg = _train_config(out, steps, batch_size, seq_len, lr, warmup, resume, eval_every, save_every, seed,
                            lora_rank=lora_rank, block_sizes=block_sizes, on_error=on_error, overwrite=overwrite)
        cfg.sft_pack = pack
        cfg.compile, cfg.bf16 = compile, bf16
        cfg.next_token_weight, cfg.suffix_fraction = next_token_weight, suffix_fraction
        cfg.mix_fraction = _mix_fraction(mix_text, mix_fraction)
        with _plain_warnings():
            res = run_finetune(cfg, model, data, eval_path=eval_data, mix_text=mix_text)
    except UnmaskError as e:
        fail(str(e))
    typer.echo(f"done: {res.steps} steps, final model in {res.model_dir}")


PROMPT_TEXT_HELP = ("Text corpus for prompts: a directory with train.jsonl, or a JSONL file of {\"text\": ...} "
                    "documents (cut at line ends).")
PROMPT_CHAT_HELP = "Chat / FIM JSONL (finetune's format) whose prompts are answered."


@app.command()
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
    teacher_dtype: Optional[str] = typer.Option(None, help=DTYPE_HELP),
    confidence_weight: float = typer.Option(2.0, min=0.0, help="Certainty forcing: weight of the entropy of the "
                                            "masked predictions the model already gets right (0: plain distillation)."),
    steps: int = typer.Option(1000), batch_size: int = typer.Option(16), seq_len: int = typer.Option(256),
    lr: float = typer.Option(2e-4), warmup: int = typer.Option(50), seed: int = typer.Option(0),
    lora_rank: int = typer.Option(0, help=">0 trains LoRA adapters of this rank (peft) instead of all weights."),
    block_sizes: Optional[str] = typer.Option(None), eval_every: int = typer.Option(100),
    save_every: int = typer.Option(100),
    mix_text: Optional[Path] = typer.Option(None, help="Corpus of plain text to replay among the trajectory rows."),
    mix_fraction: float = typer.Option(0.25, help="Share of rows taken from --mix-text."),
    resume: bool = typer.Option(False, help="Continue a killed run (checkpoint and cached trajectories)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Start over in an --out that holds an earlier run."),
    compile: bool = typer.Option(False, "--compile", help=COMPILE_HELP),
    bf16: Optional[bool] = typer.Option(None, "--bf16/--no-bf16", help=BF16_HELP, show_default=False),
    next_token_weight: float = typer.Option(1.0, min=0.0, help=NEXT_TOKEN_HELP + " Models without one ignore it."),
    suffix_fraction: float = typer.Option(0.0, min=0.0, max=1.0, help=SUFFIX_HELP),
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
                                threshold=teacher_threshold, seed=seed)
        traj.params()  # the policy and its settings are checked before the run starts
    except ValueError as e:
        fail(str(e))
    try:
        cfg = _train_config(out, steps, batch_size, seq_len, lr, warmup, resume, eval_every, save_every, seed,
                            lora_rank=lora_rank, block_sizes=block_sizes, overwrite=overwrite)
        cfg.compile, cfg.bf16 = compile, bf16
        cfg.confidence_weight, cfg.next_token_weight = confidence_weight, next_token_weight
        cfg.suffix_fraction = suffix_fraction
        cfg.mix_fraction = _mix_fraction(mix_text, mix_fraction)
        with _plain_warnings():
            res = run_distill(cfg, model, traj, text=text, chat=chat, teacher_dir=teacher, teacher_dtype=teacher_dtype,
                              mix_text=mix_text)
    except UnmaskError as e:
        fail(str(e))
    typer.echo(f"done: {res.steps} steps, final model in {res.model_dir}; compute in {out / 'distill.json'}")


@app.command()
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
    _check_output_file(json_out, "--json")
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


@app.command("eval")
def evaluate_cmd(
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="Model directory (default: built-in)."),
    corpus_dir: Path = typer.Option(Path("data/corpus"), "--corpus", help="Corpus with heldout.jsonl (unmask corpus)."),
    sft_heldout: Optional[Path] = typer.Option(
        None, "--sft-heldout", help="Held-out instruction records: infill tasks and chat endings (default: "
        "data/sft/heldout.jsonl, skipped when absent; 'none' skips them)."),
    limit: int = typer.Option(200, help="Tasks per kind."),
    policies: str = typer.Option("one_token_per_forward,threshold_0.9,threshold_0.7"),
    block_size: Optional[int] = typer.Option(None),
    repetition_penalty: Optional[float] = typer.Option(None, help="Default: the model's generation_config."),
    frequency_penalty: Optional[float] = typer.Option(None, help="Default: the model's generation_config."),
    dry_multiplier: Optional[float] = typer.Option(None, help=DRY_HELP),
    dry_sequence_breaker: Optional[list[str]] = typer.Option(
        None, help="DRY: text that ends a repeat (repeatable; 'none' for no breakers)."),
    temperature: float = typer.Option(0.0, help="Sampling temperature of the completion tasks (0 = greedy; "
                                      "the chat part stays greedy)."),
    top_p: float = typer.Option(1.0, help="Top-p of the completion tasks."),
    seed: int = typer.Option(0, help="Seed of the completion tasks when they sample."),
    chat_limit: int = typer.Option(200, help="Held-out chat records for the chat-ending rate (0: skip)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the results as JSON."),
    dtype: Optional[str] = typer.Option(None, help=DTYPE_HELP),
):
    """Held-out masked-token loss, next-line completion, single-line infill exact match and function-body
    continuation (valid Python so far, repetition), per policy; the share of held-out chat answers that
    end by themselves."""
    import json

    from unmask.engine.llm import LLM
    from unmask.errors import UnmaskError
    from unmask.evaluation import (CHAT_TOKENS, POLICIES, chat_endings, evaluate, function_tasks, infill_tasks,
                                   masked_token_loss, next_line_tasks, next_token_loss)
    from unmask.models.loader import dtype_name
    from unmask.train.corpus import read_documents
    from unmask.train.instructions import read_jsonl

    held = corpus_dir / "heldout.jsonl"
    if not held.is_file():
        fail(f"{held} not found: run `unmask corpus` first")
    if sft_heldout is None:
        default = Path("data/sft/heldout.jsonl")
        sft_heldout = default if default.is_file() else None
    elif str(sft_heldout) == "none":
        sft_heldout = None
    elif not sft_heldout.is_file():  # named explicitly: its tasks must not vanish from the results
        fail(f"--sft-heldout {sft_heldout} not found")
    _check_output_file(json_out, "--json")
    names = [p.strip() for p in policies.split(",") if p.strip()]
    if not 0.0 <= temperature <= 2.0 or not 0.0 < top_p <= 1.0:
        fail(f"--temperature must be in [0, 2] and --top-p in (0, 1], got {temperature} and {top_p}")
    bad = [n for n in names if n not in POLICIES]
    if bad:
        fail(f"unknown eval policy {bad[0]!r}; choose from {', '.join(POLICIES)}")
    try:
        llm = LLM(model, dtype=dtype)
        docs = list(read_documents(held))
        bs = block_size or llm.spec.block_size
        flags = {"repetition_penalty": repetition_penalty, "frequency_penalty": frequency_penalty,
                 "dry_multiplier": dry_multiplier, "dry_sequence_breakers": _breakers(dry_sequence_breaker)}
        penalties = _with_model_defaults(llm, dict(flags))
        penalties = {k: v for k, v in penalties.items() if v is not None}
        sampling = dict(temperature=temperature, top_p=top_p, seed=seed) if temperature > 0 else {}
        results = {"model": str(llm.spec.path), "dtype": dtype_name(llm.model.lm_head.weight.dtype),
                   "block_size": bs, "penalties": penalties, "sampling": sampling,
                   "masked_token_loss": masked_token_loss(llm, docs, bs), "tasks": []}
        typer.echo(f"masked-token loss (block {bs}): {results['masked_token_loss']:.3f}")
        results["next_token_loss"] = next_token_loss(llm, docs)
        if results["next_token_loss"] is not None:
            typer.echo(f"next-token loss (causal attention): {results['next_token_loss']:.3f}")
        task_sets = [next_line_tasks(docs, limit)]
        if sft_heldout is not None:
            task_sets.append(infill_tasks(read_jsonl(sft_heldout), limit))
        task_sets.append(function_tasks(docs, limit))
        typer.echo(f"{'task':<10} {'policy':<24} {'n':>4} {'exact':>7} {'edit sim':>8} {'valid':>6} {'repeat':>6} "
                   f"{'tok/fwd':>8} {'tok/s':>8}")
        for tasks in task_sets:
            for name in names:
                r = evaluate(llm, tasks, name, block_size=block_size, **penalties, **sampling)
                results["tasks"].append({**r.__dict__, "tokens_per_forward": r.tokens_per_forward,
                                         "tokens_per_s": r.tokens_per_s})
                valid, repeat = (("-", "-") if r.valid is None else (f"{r.valid:.0%}", f"{r.repeat:.2f}"))
                typer.echo(f"{r.task:<10} {name:<24} {r.n:>4} {r.accuracy:>7.1%} {r.edit_similarity:>8.2f} "
                           f"{valid:>6} {repeat:>6} {r.tokens_per_forward:>8.2f} {r.tokens_per_s:>8.1f}")
        fn = next((t for t in results["tasks"] if t["task"] == "function"), None)
        if fn:
            typer.echo(f"function bodies of the held-out files themselves: repeat {fn['target_repeat']:.2f}")
        if sft_heldout is not None and chat_limit > 0:
            chat_penalties = _with_model_defaults(llm, dict(flags), chat=True)
            endings = chat_endings(llm, read_jsonl(sft_heldout), chat_limit, block_size=block_size, **chat_penalties)
            results["chat_penalties"] = {k: v for k, v in chat_penalties.items() if v is not None}
            results["chat_endings"] = [{**e.__dict__, "rate": e.rate, "mean_length": e.mean_length,
                                        "mean_similarity": e.mean_similarity} for e in endings]
            n, ended = sum(e.n for e in endings), sum(e.ended for e in endings)
            typer.echo(f"chat answers that end by themselves within {CHAT_TOKENS} tokens (greedy): "
                       f"{ended}/{n} = {ended / max(n, 1):.1%}")
            for e in endings:
                valid = f", valid JSON {e.json_valid}/{e.json_n}" if e.json_n else ""
                typer.echo(f"  {e.kind:<12} {e.ended}/{e.n} = {e.rate:.0%}, mean length {e.mean_length:.0f} tokens, "
                           f"similarity {e.mean_similarity:.2f}{valid}")
    except UnmaskError as e:
        fail(str(e))
    if json_out:
        try:
            json_out.write_text(json.dumps(results, indent=2))
        except OSError as e:
            fail(f"cannot write --json {json_out}: {e.strerror}")


def _with_model_defaults(llm, knobs: dict, chat: bool = False) -> dict:
    """The model's recommended penalties (generation_config.json; with `chat`, its chat_defaults) where a
    flag left them unset."""
    from unmask.engine.params import PENALTY_KEYS, sampling_defaults

    model = sampling_defaults(llm.spec.generation_config, chat=chat)
    for key in PENALTY_KEYS:
        if knobs.get(key) is None and key in model:
            knobs[key] = model[key]
    return knobs


@app.command()
def chat(
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="Model directory (default: built-in unmask-tiny)."),
    system: Optional[str] = typer.Option(None, help="System message that opens the conversation."),
    policy: str = typer.Option("threshold", help="Decoding policy (see docs/decoding.md)."),
    threshold: float = typer.Option(0.9, help="Confidence threshold for threshold/credit policies."),
    max_tokens: int = typer.Option(512, help="Maximum tokens per reply."),
    temperature: float = typer.Option(0.0, help="Sampling temperature (0 = greedy)."),
    seed: Optional[int] = typer.Option(None, help="Seed for reproducible sampling."),
    presence_penalty: Optional[float] = typer.Option(None, help="Default: the model's generation_config."),
    frequency_penalty: Optional[float] = typer.Option(None, help="Default: the model's generation_config."),
    repetition_penalty: Optional[float] = typer.Option(None, help="Default: the model's generation_config."),
    dry_multiplier: Optional[float] = typer.Option(None, help=DRY_HELP),
    stats: bool = typer.Option(False, help="After each reply: tokens, forwards, tokens per forward, tokens/s."),
    dtype: Optional[str] = typer.Option(None, help=DTYPE_HELP),
    device: str = typer.Option("auto", help=DEVICE_HELP),
):
    """Chat in the terminal through the model's chat template; replies stream as their tokens are committed.
    /reset starts over, /exit (or end of input) quits."""
    import dataclasses

    from unmask.engine.llm import LLM
    from unmask.errors import ContextLengthError, UnmaskError

    knobs = dict(max_tokens=max_tokens, temperature=temperature, seed=seed, policy=policy, threshold=threshold,
                 presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                 repetition_penalty=repetition_penalty, dry_multiplier=dry_multiplier)
    try:
        _params(**knobs)
        llm = LLM(model, dtype=dtype, device=device)
        if not llm.tokenizer.has_chat_template:
            fail(f"{llm.spec.path} has no chat template: use `unmask generate` for plain completion")
        params = _params(**_with_model_defaults(llm, knobs, chat=True))
    except UnmaskError as e:
        fail(str(e))
    opening = [{"role": "system", "content": system}] if system else []
    # load the template's tokenizer before the prompt, not in the first reply (0.8 s with the built-in model);
    # a real turn that the template refuses reports its own error
    with contextlib.suppress(Exception):
        llm.tokenizer.apply_chat_template([*opening, {"role": "user", "content": "warm-up"}])
    messages = list(opening)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        text = line.strip()
        if not text:
            continue
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:
            typer.echo("error: the input is not valid UTF-8", err=True)
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            messages = list(opening)
            typer.echo("(new conversation)")
            continue
        messages.append({"role": "user", "content": line})
        reply, last, t0 = "", None, time.perf_counter()
        try:
            ids = llm.chat_prompt(messages)
            room = llm.spec.max_context - len(ids)  # as llama.cpp's server: the reply gets what context is left
            if room < 1:
                raise ContextLengthError(f"the conversation ({len(ids)} tokens) fills this model's context of "
                                         f"{llm.spec.max_context}: /reset to start over")
            turn = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
            for out in llm.stream(ids, turn):
                sys.stdout.write(out.text_delta)
                sys.stdout.flush()
                reply, last = reply + out.text_delta, out
        except UnmaskError as e:  # e.g. the conversation outgrew the context: the turn is dropped
            messages.pop()
            typer.echo(f"error: {e}", err=True)
            continue
        typer.echo("")
        messages.append({"role": "assistant", "content": reply})
        if stats and last is not None:
            n, dt = last.num_generated, time.perf_counter() - t0
            typer.echo(f"[{n} tokens, {last.forwards} forwards, {n / max(last.forwards, 1):.2f} tokens/forward, "
                       f"{n / dt:.1f} tokens/s, finish={last.finish_reason}]", err=True)


@app.command()
def bench(
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="Model directory (default: built-in unmask-tiny)."),
    batch: str = typer.Option("1,4,16", help="Batch sizes, comma-separated."),
    prompt_len: int = typer.Option(128, help="Prompt tokens per request (random ids)."),
    max_tokens: int = typer.Option(128, help="Generated tokens per request (end-of-sequence ignored)."),
    rounds: int = typer.Option(3, help="Interleaved rounds; figures are median [min-max]."),
    policy: str = typer.Option("threshold", help="Decoding policy (see docs/decoding.md)."),
    threshold: float = typer.Option(0.9), block_size: Optional[int] = typer.Option(None),
    steps: Optional[int] = typer.Option(None), seed: int = typer.Option(0),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the results as JSON."),
    dtype: Optional[str] = typer.Option(None, help=DTYPE_HELP), device: str = typer.Option("auto", help=DEVICE_HELP),
):
    """Offline throughput at several batch sizes (unmask.throughput; the full suite is `make bench`)."""
    import json

    from unmask.engine.llm import LLM
    from unmask.errors import UnmaskError
    from unmask.throughput import measure

    try:
        sizes = [int(b) for b in batch.split(",") if b.strip()]
    except ValueError:
        fail(f"--batch must be comma-separated integers, got {batch!r}")
    _check_output_file(json_out, "--json")
    if not sizes or min(sizes) < 1 or prompt_len < 1 or rounds < 1:
        fail("--batch sizes, --prompt-len and --rounds must be >= 1")
    knobs = {k: v for k, v in dict(policy=policy, threshold=threshold, block_size=block_size, steps=steps).items()
             if v is not None}
    try:
        _params(max_tokens=max_tokens, **knobs)
        llm = LLM(model, dtype=dtype, device=device, max_num_seqs=max(sizes))
        results = measure(llm, sizes, prompt_len, max_tokens, rounds, knobs, seed,
                          log=lambda m: typer.echo(m, err=True))
    except (UnmaskError, ValueError) as e:
        fail(str(e))
    rows = [r.summary() for r in results]
    typer.echo(f"model {llm.spec.path} ({llm.spec.family.name}), policy {policy}, prompt {prompt_len}, "
               f"{max_tokens} tokens per request, {rounds} rounds, torch threads {__import__('torch').get_num_threads()}")
    typer.echo(f"{'batch':>5} {'tokens/s':>22} {'ms/token/request':>18} {'tokens/forward':>15} {'engine steps':>13}")
    for r in rows:
        t, lat = r["tokens_per_s"], r["latency_ms_per_token"]
        typer.echo(f"{r['batch']:>5} {t['median']:>8.1f} [{t['min']:.1f}-{t['max']:.1f}]".ljust(28)
                   + f" {lat['median']:>18.2f} {r['tokens_per_forward']['median']:>15.2f} "
                   f"{r['engine_steps']['median']:>13.0f}")
    if json_out:
        json_out.write_text(json.dumps({"model": str(llm.spec.path), "policy": policy, "knobs": knobs,
                                        "prompt_len": prompt_len, "max_tokens": max_tokens, "results": rows},
                                       indent=2))


def _register_optional_commands() -> None:
    # command modules import their heavy dependencies (fastapi, the trainer) inside the command body
    try:
        from unmask.server import cli as server_cli
    except ImportError:
        return
    app.command("serve")(server_cli.serve)


_register_optional_commands()


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
