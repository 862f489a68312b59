"""Command line: unmask generate | chat | bench | corpus | eval (unmask.evaluation_cli), plus the training commands
(unmask.train.cli: train | finetune | distill | calibrate) and serve (unmask.server.cli)."""
from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from unmask.cli_util import (DRY_HELP, check_output_file, check_utf8, dry_breakers, fail, generation_params,
                             static_step_options, with_model_defaults)
from unmask.defaults import (CUDA_GRAPHS_HELP, DEVICE_HELP, DTYPE_HELP, KV_CACHE_DTYPE_HELP, KV_POOL_TOKENS_HELP,
                             MEMORY_UTILIZATION_HELP, STATIC_STEP_HELP, COMPILE_STEP_HELP)
from unmask.evaluation_cli import evaluate_cmd

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Inference engine, trainer and server for diffusion language models.")


@app.callback()
def _root() -> None:
    """Inference engine, trainer and server for diffusion language models."""


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="Prompt text (use --chat to wrap it in the chat template)."),
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="Model directory (default: built-in unmask-tiny)."),
    policy: str = typer.Option("default", help="Decoding policy (docs/decoding.md); default: the model's own."),
    threshold: float = typer.Option(0.9, help="Confidence threshold for threshold/credit policies."),
    block_size: Optional[int] = typer.Option(None, help="Block size (default: the model's)."),
    steps: Optional[int] = typer.Option(None, help="Denoising steps per block for schedule-based policies."),
    tokens_per_step: Optional[int] = typer.Option(None, help="Fixed tokens per step for the topk policy."),
    factor: float = typer.Option(1.0, help="f of the factor policy (> 0; larger commits more per step)."),
    entropy_bound: Optional[float] = typer.Option(
        None, help="entropy_bounded policy's bound in nats, >= 0 (default 0.35); DiffusionGemma's acceptance bound."),
    small_block_size: Optional[int] = typer.Option(
        None, help="Fast-dLLM v2 sub-blocks: decode only the leftmost slice of this many tokens that has masks "
                   "(divides the block size; block-causal families; default: the model's, Fast-dLLM v2 8; "
                   "the block size turns it off)."),
    multi_block_threshold: Optional[float] = typer.Option(
        None, help="Start the next block once this share of the active one is committed (causal-context models)."),
    draft_all_outcomes: Optional[bool] = typer.Option(
        None, "--draft-all-outcomes/--no-draft-all-outcomes",
        help="Policy speculative: a draft block for every number of diffusion drafts the verifier may keep "
             "(default: off)."),
    draft_lookup: Optional[int] = typer.Option(
        None, help="Policy speculative: also draft up to this many tokens copied from an earlier occurrence of the "
                   "text's last few tokens (prompt lookup; 0: off; default: the model's)."),
    draft_ngrams: Optional[bool] = typer.Option(
        None, "--draft-ngrams/--no-draft-ngrams",
        help="Policy speculative, with --draft-lookup: where the copy finds nothing, draft from the model's table of "
             "its training text's n-grams (default: on where the model has one)."),
    greedy_filters: Optional[bool] = typer.Option(
        None, "--greedy-filters/--no-greedy-filters",
        help="At temperature 0, read confidences from the top-k / top-p filtered softmax (default: the model's; "
             "Dream: on)."),
    empty_steps: Optional[bool] = typer.Option(
        None, "--empty-steps/--no-empty-steps",
        help="Dream's schedules may commit nothing on a step, as the reference does (default: the model's; Dream: on)."),
    full_last_block: Optional[bool] = typer.Option(
        None, "--full-last-block/--no-full-last-block",
        help="Decode the last block at full size and cut the output at --max-tokens afterwards (SDAR's and "
             "LLaDA2's references; block-causal families; default off)."),
    ordered_stops: Optional[bool] = typer.Option(
        None, "--ordered-stops/--no-ordered-stops",
        help="Commit a stop token only at the first undecided position (default: the model's; the built-in "
             "family: on)."),
    edit_threshold: Optional[float] = typer.Option(
        None, help="LLaDA2.1 edits: also replace a filled token of the active block whose proposal differs with "
                   "probability above this, in [0, 1] (default off; docs/decoding.md)."),
    max_post_edit_steps: Optional[int] = typer.Option(
        None, help="Edit-only steps once a block is full, stopping at the first that changes nothing (default 16)."),
    remask_budget: Optional[int] = typer.Option(
        None, help="ReMDM-style: put up to this many low-confidence tokens per block back to mask (default off)."),
    remask_threshold: Optional[float] = typer.Option(
        None, help="With --remask-budget: remask a token whose own probability is below this (default 0.5)."),
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
    kv_cache_dtype: str = typer.Option("auto", help=KV_CACHE_DTYPE_HELP),
    device: str = typer.Option("auto", help=DEVICE_HELP),
    static_step: Optional[bool] = typer.Option(None, "--static-step/--no-static-step", help=STATIC_STEP_HELP),
    compile_step: Optional[bool] = typer.Option(None, "--compile-step/--no-compile-step", help=COMPILE_STEP_HELP),
    cuda_graphs: Optional[bool] = typer.Option(None, "--cuda-graphs/--no-cuda-graphs", help=CUDA_GRAPHS_HELP),
    gpu_memory_utilization: Optional[float] = typer.Option(None, envvar="UNMASK_GPU_MEMORY_UTILIZATION",
                                                           help=MEMORY_UTILIZATION_HELP),
    kv_pool_tokens: Optional[int] = typer.Option(None, envvar="UNMASK_KV_POOL_TOKENS", help=KV_POOL_TOKENS_HELP),
):
    """Generate text for one prompt and print it."""
    from unmask.engine.llm import LLM
    from unmask.errors import InvalidRequestError, UnmaskError

    try:
        knobs = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                     policy=policy, threshold=threshold, block_size=block_size, steps=steps,
                     tokens_per_step=tokens_per_step, factor=factor, entropy_bound=entropy_bound, alg_temp=alg_temp,
                     small_block_size=small_block_size, multi_block_threshold=multi_block_threshold,
                     draft_all_outcomes=draft_all_outcomes, draft_lookup=draft_lookup, draft_ngrams=draft_ngrams,
                     greedy_filters=greedy_filters, empty_steps=empty_steps, full_last_block=full_last_block,
                     ordered_stops=ordered_stops, credit_decay=credit_decay, edit_threshold=edit_threshold,
                     max_post_edit_steps=max_post_edit_steps, remask_budget=remask_budget,
                     remask_threshold=remask_threshold, credit_gamma=credit_gamma, credit_weight=credit_weight, cache=cache, stop=list(stop),
                     presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                     repetition_penalty=repetition_penalty, dry_multiplier=dry_multiplier, dry_base=dry_base,
                     dry_allowed_length=dry_allowed_length, dry_penalty_last_n=dry_penalty_last_n,
                     dry_sequence_breakers=dry_breakers(dry_sequence_breaker))
        generation_params(**knobs)  # bad flags fail before the model loads
        fast = static_step_options(static_step, cuda_graphs, gpu_memory_utilization, kv_pool_tokens, compile_step)
        check_utf8(prompt, "the prompt")
        llm = LLM(model, dtype=dtype, device=device, kv_cache_dtype=kv_cache_dtype, **fast)
        # --chat: a chat answer, as the server's
        params = generation_params(**with_model_defaults(llm, knobs, chat=chat))
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
        revised = f", {last.edits} edits, {last.remasks} remasks" if last.edits or last.remasks else ""
        used = llm.engine.resolve_policy(params)  # a request without --policy: the model's default
        typer.echo(f"[policy {used.policy}, {n} tokens, {last.forwards} forwards, "
                   f"{n / max(last.forwards, 1):.2f} tokens/forward, {n / elapsed:.1f} tokens/s{revised}, "
                   f"finish={last.finish_reason}]", err=True)


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


app.command("eval")(evaluate_cmd)  # here, so that --help lists it after corpus, as before


@app.command()
def chat(
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="Model directory (default: built-in unmask-tiny)."),
    system: Optional[str] = typer.Option(None, help="System message that opens the conversation."),
    policy: str = typer.Option("default", help="Decoding policy (docs/decoding.md); default: the model's own."),
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
        generation_params(**knobs)
        llm = LLM(model, dtype=dtype, device=device)
        if not llm.tokenizer.has_chat_template:
            fail(f"{llm.spec.path} has no chat template: use `unmask generate` for plain completion")
        params = generation_params(**with_model_defaults(llm, knobs, chat=True))
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
    policy: str = typer.Option("default", help="Decoding policy (docs/decoding.md); default: the model's own."),
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
    check_output_file(json_out, "--json")
    if not sizes or min(sizes) < 1 or prompt_len < 1 or rounds < 1:
        fail("--batch sizes, --prompt-len and --rounds must be >= 1")
    knobs = {k: v for k, v in dict(policy=policy, threshold=threshold, block_size=block_size, steps=steps).items()
             if v is not None}
    try:
        generation_params(max_tokens=max_tokens, **knobs)
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
    from unmask.batch import cli as batch_cli
    from unmask.loadtest import cli as loadtest_cli
    from unmask.train import cli as train_cli

    for command in (train_cli.train, train_cli.finetune, train_cli.distill, train_cli.calibrate, train_cli.ngram_drafts,
                    loadtest_cli.loadtest, batch_cli.batch):
        app.command()(command)
    try:
        from unmask.server import cli as server_cli
    except ImportError:
        return
    app.command("serve")(server_cli.serve)


_register_optional_commands()


def main() -> None:
    from unmask.allocator import maybe_reexec

    maybe_reexec(sys.argv)   # training commands run under jemalloc where it is installed (allocator.py)
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
