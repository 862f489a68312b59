"""What every command module of the CLI shares: one-line errors, plain warnings, output-file checks, and the
generation flags of generate, chat, eval and bench (DRY breakers, the model's default penalties)."""
from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path

import typer


def fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


@contextlib.contextmanager
def plain_warnings():
    """Warnings (skipped records, ...) as `warning: …` lines on stderr, without Python's file:line and source line."""
    with warnings.catch_warnings():
        warnings.showwarning = lambda message, *_a, **_k: typer.echo(f"warning: {message}", err=True)
        yield


def check_utf8(text: str, what: str) -> None:
    """Bytes that are not UTF-8 reach Python as lone surrogates, which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        fail(f"{what} is not valid UTF-8")


def check_output_file(path: Path | None, flag: str) -> None:
    """Before a long run: a results file that cannot be written would lose its results at the end."""
    if path is None:
        return
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir() or not parent.is_dir() or not os.access(parent, os.W_OK):
        fail(f"{flag} {path} cannot be written (a directory, or its folder is missing or read-only)")


def static_step_options(static_step: bool | None, cuda_graphs: bool | None, memory_utilization: float | None,
                        kv_pool_tokens: int | None, compile_step: bool | None = None, serving: bool = False) -> dict:
    """The LLM keywords of --static-step, --cuda-graphs, --gpu-memory-utilization, --kv-pool-tokens and
    --compile-step (`unmask generate` and `unmask serve`), or a one-line error: a value out of range, or a pool
    size without the static step that would use it. `serving`: the compiled step's default is "auto" (the
    one-request forward compiled at start where the model qualifies) rather than off."""
    from unmask.engine.kv_pool import check_pool_options
    from unmask.errors import InvalidRequestError

    # the variables are read here (not by typer, whose error for a bad boolean is a box of lines), strictly
    static_step = env_switch("UNMASK_STATIC_STEP", static_step, False)
    cuda_graphs = env_switch("UNMASK_CUDA_GRAPHS", cuda_graphs, True)
    compile_step = env_switch("UNMASK_COMPILE_STEP", compile_step, "auto" if serving else False, also=("auto",))
    try:
        check_pool_options(0.9 if memory_utilization is None else memory_utilization, kv_pool_tokens,
                           names=("--gpu-memory-utilization", "--kv-pool-tokens"))
    except InvalidRequestError as e:
        fail(str(e))
    if not static_step:
        for flag, value in (("--kv-pool-tokens", kv_pool_tokens), ("--gpu-memory-utilization", memory_utilization)):
            if value is not None:
                fail(f"{flag} sizes the static step's KV pool: add --static-step (or UNMASK_STATIC_STEP=1)")
    return dict(static_step=static_step, cuda_graphs=cuda_graphs, compile_step=compile_step,
                kv_pool_tokens=kv_pool_tokens,
                memory_utilization=0.9 if memory_utilization is None else memory_utilization)


SWITCH_VALUES = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def env_switch(name: str, flag: bool | None, default: bool | str, also: tuple[str, ...] = ()) -> bool | str:
    """A --x/--no-x flag, else the variable `name` (1/true/yes/on or 0/false/no/off, or one of the words `also`
    allows, returned as written), else `default`."""
    if flag is not None:
        return flag
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    word = raw.strip().lower()
    if word in also:
        return word
    if word not in SWITCH_VALUES:
        fail(f"{name} must be one of {', '.join((*SWITCH_VALUES, *also))}, got {raw!r}")
    return SWITCH_VALUES[word]


DRY_HELP = ("DRY loop penalty (llama.cpp's): penalise the token that would extend a repeat of an earlier "
            "run of tokens, multiplier * base^(length - allowed length); 0 = off (default: the model's "
            "generation_config). docs/decoding.md")


def dry_breakers(values: list[str] | None) -> list[str] | None:
    """--dry-sequence-breaker values: unset -> None (the default set), 'none' -> no breakers; a typed \\n or
    \\t is a newline or tab, as in llama.cpp's CLI."""
    if not values:
        return None
    if values == ["none"]:
        return []
    return [v.replace("\\n", "\n").replace("\\t", "\t") for v in values]


def generation_params(**kw):
    from unmask.engine.params import GenerationParams

    return GenerationParams(**{k: v for k, v in kw.items() if v is not None})


def with_model_defaults(llm, knobs: dict, chat: bool = False) -> dict:
    """The model's recommended penalties (generation_config.json; with `chat`, its chat_defaults) where a
    flag left them unset."""
    from unmask.engine.params import PENALTY_KEYS, sampling_defaults

    model = sampling_defaults(llm.spec.generation_config, chat=chat)
    for key in PENALTY_KEYS:
        if knobs.get(key) is None and key in model:
            knobs[key] = model[key]
    return knobs
