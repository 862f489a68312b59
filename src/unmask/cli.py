"""Command line: unmask generate | train | finetune | eval | bench | serve."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer

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
    max_tokens: int = typer.Option(128, help="Maximum tokens to generate."),
    temperature: float = typer.Option(0.0, help="Sampling temperature (0 = greedy)."),
    top_p: float = typer.Option(1.0), top_k: int = typer.Option(0),
    seed: Optional[int] = typer.Option(None, help="Seed for reproducible sampling."),
    cache: str = typer.Option("auto", help="Bidirectional families: none | prefix | dual."),
    stop: list[str] = typer.Option([], help="Stop string (repeatable, up to 4)."),
    chat: bool = typer.Option(False, help="Render the prompt as one user turn with the chat template."),
    stats: bool = typer.Option(False, help="Print tokens, forwards, tokens per forward and tokens/s."),
    dtype: Optional[str] = typer.Option(None, help="float32 | bfloat16 | float16 (default: float32 on CPU)."),
    device: str = typer.Option("cpu"),
):
    """Generate text for one prompt and print it."""
    from unmask.engine.llm import LLM
    from unmask.errors import UnmaskError

    try:
        params = _params(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                         policy=policy, threshold=threshold, block_size=block_size, steps=steps,
                         tokens_per_step=tokens_per_step, cache=cache, stop=list(stop))
        llm = LLM(model, dtype=dtype, device=device)
        ids = llm.chat_prompt([{"role": "user", "content": prompt}]) if chat else llm.encode(prompt)
        t0 = time.perf_counter()
        out = llm.generate(ids, params)[0]
        elapsed = time.perf_counter() - t0
    except UnmaskError as e:
        fail(str(e))
    typer.echo(out.text if chat else prompt + out.text)
    if stats:
        n = len(out.token_ids)
        typer.echo(f"[{n} tokens, {out.forwards} forwards, {out.tokens_per_forward:.2f} tokens/forward, "
                   f"{n / elapsed:.1f} tokens/s, finish={out.finish_reason}]", err=True)


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
