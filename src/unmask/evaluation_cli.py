"""`unmask eval`: held-out losses, completion / infill / function-body tasks per policy, chat endings, or the
needle in a haystack (registered by unmask.cli; the measurements are in unmask.evaluation*)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from unmask.cli_util import DRY_HELP, check_output_file, dry_breakers, fail, with_model_defaults
from unmask.defaults import DTYPE_HELP


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
    chat_policies: str = typer.Option("default", help="Policies of the chat-ending part, comma-separated eval "
                                      "policies or 'default' (the model's default policy)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the results as JSON."),
    dtype: Optional[str] = typer.Option(None, help=DTYPE_HELP),
    kv_cache_dtype: str = typer.Option("auto", help="Also the masked-token loss read through a KV cache of this "
                                       "dtype (bfloat16 | float32 | int8; block-causal families): what the cache dtype costs."),
    needle: bool = typer.Option(False, "--needle", help="Run only the needle in a haystack: a passkey line at "
                                "each depth of held-out text, at each length; exact match of the value."),
    needle_lengths: str = typer.Option("1024,4096,16384,65536,131072", help="--needle prompt lengths in tokens."),
    needle_depths: str = typer.Option("0,0.25,0.5,0.75,1", help="--needle depths, 0 (start) to 1 (end)."),
    needle_trials: int = typer.Option(2, min=1, help="--needle prompts per length and depth."),
    needle_policy: str = typer.Option(
        "threshold_0.9", help="--needle decoding policy: one of the eval policies, or default (the model's own)."),
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
    check_output_file(json_out, "--json")
    names = [p.strip() for p in policies.split(",") if p.strip()]
    if not 0.0 <= temperature <= 2.0 or not 0.0 < top_p <= 1.0:
        fail(f"--temperature must be in [0, 2] and --top-p in (0, 1], got {temperature} and {top_p}")
    chat_names = [p.strip() for p in chat_policies.split(",") if p.strip()]
    bad = [n for n in names if n not in POLICIES] + [n for n in chat_names if n not in POLICIES and n != "default"]
    if bad:
        fail(f"unknown eval policy {bad[0]!r}; choose from {', '.join(POLICIES)}")
    try:
        llm = LLM(model, dtype=dtype)
        docs = list(read_documents(held))
        if needle:
            return _needle(llm, docs, needle_lengths, needle_depths, needle_trials, needle_policy, json_out)
        bs = block_size or llm.spec.block_size
        flags = {"repetition_penalty": repetition_penalty, "frequency_penalty": frequency_penalty,
                 "dry_multiplier": dry_multiplier, "dry_sequence_breakers": dry_breakers(dry_sequence_breaker)}
        penalties = with_model_defaults(llm, dict(flags))
        penalties = {k: v for k, v in penalties.items() if v is not None}
        sampling = dict(temperature=temperature, top_p=top_p, seed=seed) if temperature > 0 else {}
        results = {"model": str(llm.spec.path), "dtype": dtype_name(llm.model.lm_head.weight.dtype),
                   "block_size": bs, "penalties": penalties, "sampling": sampling,
                   "masked_token_loss": masked_token_loss(llm, docs, bs), "tasks": []}
        typer.echo(f"masked-token loss (block {bs}): {results['masked_token_loss']:.3f}")
        if kv_cache_dtype != "auto":
            from unmask.engine.memory import resolve_kv_cache_dtype
            from unmask.evaluation_cache import cached_masked_token_loss

            cached = cached_masked_token_loss(llm, docs, bs, resolve_kv_cache_dtype(kv_cache_dtype))
            results["cached_masked_token_loss"] = {"kv_cache_dtype": kv_cache_dtype, "loss": cached}
            typer.echo(f"masked-token loss through a {kv_cache_dtype} KV cache: {cached:.5f} (the same rows and "
                       f"noise: {results['masked_token_loss']:.5f} without a cache)")
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
            chat_penalties = with_model_defaults(llm, dict(flags), chat=True)
            results["chat_penalties"] = {k: v for k, v in chat_penalties.items() if v is not None}
            results["chat_endings_by_policy"] = {}
            for name in chat_names:
                knobs = {**POLICIES.get(name, {}), **{k: v for k, v in chat_penalties.items() if v is not None}}
                if block_size is not None:
                    knobs["block_size"] = block_size
                endings = chat_endings(llm, read_jsonl(sft_heldout), chat_limit, **knobs)
                rows = [{**e.__dict__, "rate": e.rate, "mean_length": e.mean_length,
                         "mean_similarity": e.mean_similarity} for e in endings]
                results["chat_endings_by_policy"][name] = rows
                results.setdefault("chat_endings", rows)  # the first policy's, as before
                n, ended = sum(e.n for e in endings), sum(e.ended for e in endings)
                typer.echo(f"chat answers that end by themselves within {CHAT_TOKENS} tokens (greedy, {name}): "
                           f"{ended}/{n} = {ended / max(n, 1):.1%}")
                for e in endings:
                    valid = f", valid JSON {e.json_valid}/{e.json_n}" if e.json_n else ""
                    typer.echo(f"  {e.kind:<12} {e.ended}/{e.n} = {e.rate:.0%}, mean length {e.mean_length:.0f} "
                               f"tokens, similarity {e.mean_similarity:.2f}{valid}")
    except UnmaskError as e:
        fail(str(e))
    if json_out:
        try:
            json_out.write_text(json.dumps(results, indent=2))
        except OSError as e:
            fail(f"cannot write --json {json_out}: {e.strerror}")


def _needle(llm, docs, lengths: str, depths: str, trials: int, policy: str, json_out: Optional[Path]) -> None:
    import json

    from unmask.engine.params import DEFAULT_POLICY
    from unmask.evaluation import POLICIES
    from unmask.evaluation_needle import report

    if policy != DEFAULT_POLICY and policy not in POLICIES:   # the CLI's own words: the option's name
        fail(f"unknown --needle-policy {policy!r}; choose from {DEFAULT_POLICY}, {', '.join(POLICIES)}")
    try:
        sizes = [int(n) for n in lengths.split(",") if n.strip()]
        fractions = [float(d) for d in depths.split(",") if d.strip()]
    except ValueError:
        fail(f"--needle-lengths takes token counts and --needle-depths fractions, got {lengths!r} and {depths!r}")
    if not sizes or not fractions or min(sizes) < 32 or not all(0 <= d <= 1 for d in fractions):
        fail("--needle-lengths must be token counts of at least 32 and --needle-depths fractions in [0, 1]")
    results = report(llm, docs, sizes, fractions, trials, policy, log=lambda line: typer.echo(line, err=True))
    typer.echo(f"needle in a haystack ({policy}, {trials} per cell; * past the configured context of "
               f"{results['configured_context']}): accuracy by depth and length")
    typer.echo(results["table"])
    if json_out:
        try:
            json_out.write_text(json.dumps(results, indent=2))
        except OSError as e:
            fail(f"cannot write --json {json_out}: {e.strerror}")
