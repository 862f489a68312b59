"""`unmask loadtest`: the typer command (registered by unmask.cli). Checks every input before the run,
turns each into one `error: ...` line, then hands the run to unmask.loadtest.run."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Optional

import typer

from unmask.cli_util import check_output_file, fail

DATASETS = ("random", "jsonl", "sharegpt", "heldout")


def _numbers(spec: str, flag: str, integer: bool) -> list[float]:
    try:
        values = [int(v) if integer else float(v) for v in spec.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(not v > 0 or (integer and v > 100000) or math.isnan(v) for v in values):
        kind = "positive integers" if integer else "positive numbers (inf: all at once)"
        fail(f"{flag} must be comma-separated {kind}, got {spec!r}")
    return values


def _extra_body(text: Optional[str], flag: str) -> dict:
    if not text:
        return {}
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        fail(f"{flag} is not JSON ({e.msg}): {text[:80]!r}")
    if not isinstance(body, dict):
        fail(f"{flag} must be a JSON object, got {text[:80]!r}")
    return body


def _url(url: str, flag: str) -> str:
    if not url.startswith(("http://", "https://")):
        fail(f"{flag} must be an http:// or https:// base URL, got {url!r}")
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _token_counter(directory: Path):
    path = directory / "tokenizer.json"
    if not path.is_file():
        fail(f"--tokenizer {directory}: no tokenizer.json there")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def loadtest(
    url: str = typer.Option("http://127.0.0.1:8000", "--url", help="Base URL of an OpenAI-compatible server."),
    endpoint: str = typer.Option("chat", help="chat (/v1/chat/completions) or completions (/v1/completions)."),
    model: Optional[str] = typer.Option(None, help="Model id (default: the first of GET /v1/models)."),
    api_key: Optional[str] = typer.Option(None, envvar="UNMASK_LOADTEST_API_KEY", help="Bearer key."),
    extra_body: Optional[str] = typer.Option(
        None, help="JSON object merged into every request body, e.g. '{\"reasoning_effort\": \"low\"}'."),
    stream: bool = typer.Option(True, "--stream/--no-stream",
                                help="Stream (TTFT, TPOT, ITL measured) or not (end-to-end only)."),
    compare: Optional[str] = typer.Option(
        None, help="A second base URL, run interleaved with --url (A B A B) on the same prompts."),
    compare_model: Optional[str] = typer.Option(None, help="Model id at --compare (default: its first)."),
    compare_api_key: Optional[str] = typer.Option(None, help="Key for --compare (default: --api-key)."),
    compare_extra_body: Optional[str] = typer.Option(None, help="--extra-body for --compare (default: the same)."),
    dataset: str = typer.Option("random", help="random | jsonl | sharegpt | heldout (docs/loadtest.md)."),
    dataset_path: Optional[Path] = typer.Option(
        None, help="The JSONL / ShareGPT file, or for heldout the corpus directory (default data/corpus)."),
    input_len: str = typer.Option("32", help="random: prompt length in words, N or LO:HI (uniform)."),
    output_len: Optional[str] = typer.Option(
        None, help="max_tokens per request, N or LO:HI (uniform); default 32, or the file's own where it sets one."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos/--no-ignore-eos",
                                    help="Send ignore_eos so answers run to max_tokens (vLLM, unmask, ...)."),
    temperature: float = typer.Option(0.0, help="Sampling temperature."),
    num_requests: int = typer.Option(32, "--num-requests", "-n", help="Requests per sweep point and target."),
    concurrency: Optional[str] = typer.Option(None, help="Closed-loop clients, swept: e.g. 1,2,4,8 (default 1)."),
    rate: Optional[str] = typer.Option(None, help="Poisson request rates per second, swept: e.g. 1,2,inf."),
    max_concurrency: Optional[int] = typer.Option(None, help="With --rate: at most this many in flight."),
    rounds: int = typer.Option(0, help="Split each point into this many rounds, alternating targets "
                                       "(default: 2 with --compare, else 1)."),
    warmup: int = typer.Option(1, help="Unmeasured requests per target before the run."),
    goodput: Optional[list[str]] = typer.Option(
        None, help="SLOs in ms for goodput, e.g. --goodput 'ttft:500 tpot:50' (keys ttft, tpot, e2el)."),
    tokenizer: Optional[Path] = typer.Option(None, help="Directory with tokenizer.json: cross-check usage counts."),
    dollars_per_hour: Optional[float] = typer.Option(None, help="Machine price: cost per 1M output tokens and "
                                                                "per 1,000 requests."),
    timeout: float = typer.Option(600.0, help="Seconds per request before it fails as a timeout."),
    preconnect: int = typer.Option(0, help="Open this many connections, untimed, before each round."),
    burst: int = typer.Option(0, help="Instead of a sweep: write this many requests at once on connections "
                                      "opened first, and report statuses, Retry-After and latency to the status "
                                      "line (the overload case; docs/loadtest.md)."),
    seed: int = typer.Option(0, help="Seed of prompts, lengths and arrival times."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the results here."),
    plot: Optional[Path] = typer.Option(None, help="Write latency/throughput plots here (PNG)."),
):
    """Load test any OpenAI-compatible endpoint: TTFT, TPOT, ITL, end-to-end latency, throughput, goodput and
    cost, over swept concurrency levels or Poisson request rates (docs/loadtest.md)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from unmask.loadtest import metrics, report, workloads
    from unmask.loadtest.client import Target
    from unmask.loadtest.run import LoadtestError, Plan, run_sync

    if endpoint not in ("chat", "completions"):
        fail(f"--endpoint must be chat or completions, got {endpoint!r}")
    if dataset not in DATASETS:
        fail(f"--dataset must be one of {', '.join(DATASETS)}, got {dataset!r}")
    if num_requests < 1 or warmup < 0 or rounds < 0 or not timeout > 0 or not 0 <= preconnect <= 10000:
        fail("--num-requests must be >= 1, --warmup and --rounds >= 0, --timeout > 0, --preconnect 0-10000")
    if concurrency and rate:
        fail("give --concurrency or --rate, not both (sweep one at a time)")
    if burst and (concurrency or rate or compare or plot or goodput or not 1 <= burst <= 100000):
        fail("--burst N (1-100000) is a run of its own: not with --concurrency, --rate, --compare, --plot or "
             "--goodput")
    if max_concurrency is not None and (max_concurrency < 1 or not rate):
        fail("--max-concurrency must be >= 1 and goes with --rate")
    if dollars_per_hour is not None and not (dollars_per_hour >= 0 and math.isfinite(dollars_per_hour)):
        fail(f"--dollars-per-hour must be a non-negative number, got {dollars_per_hour}")
    sweep, values = ("rate", _numbers(rate, "--rate", False)) if rate else \
        ("concurrency", _numbers(concurrency or "1", "--concurrency", True))
    try:
        slos = metrics.parse_slos(" ".join(goodput)) if goodput else None
    except ValueError as e:
        fail(str(e))
    if slos and not stream and {"ttft", "tpot"} & set(slos):
        fail("--goodput ttft/tpot need --stream (without it only e2el is measured)")
    check_output_file(json_out, "--json")
    check_output_file(plot, "--plot")
    count_tokens = _token_counter(tokenizer) if tokenizer else None
    try:
        out_range = workloads.parse_length(output_len or "32", "--output-len")
        if dataset == "random":
            prompts = workloads.random_prompts(num_requests, workloads.parse_length(input_len, "--input-len"),
                                               out_range, seed)
        elif dataset_path is None and dataset != "heldout":
            fail(f"--dataset {dataset} needs --dataset-path")
        elif dataset == "jsonl":
            prompts = workloads.jsonl_prompts(dataset_path)
        elif dataset == "sharegpt":
            prompts = workloads.sharegpt_prompts(dataset_path)
        else:
            prompts = workloads.heldout_prompts(dataset_path or Path("data/corpus"), max(num_requests, 32))
    except workloads.WorkloadError as e:
        fail(str(e))
    except UnicodeDecodeError:
        fail(f"{dataset_path} is not valid UTF-8")
    if burst:
        num_requests = burst
    work = workloads.budgets(workloads.cycle(prompts, num_requests, seed), out_range, output_len is None, seed)

    common = dict(endpoint=endpoint, stream=stream, ignore_eos=ignore_eos, temperature=temperature,
                  timeout=timeout)
    targets = [Target("A", _url(url, "--url"), model, api_key, extra_body=_extra_body(extra_body, "--extra-body"),
                      **common)]
    if compare:
        targets.append(Target("B", _url(compare, "--compare"), compare_model, compare_api_key or api_key,
                              extra_body=_extra_body(compare_extra_body, "--compare-extra-body")
                              if compare_extra_body else dict(targets[0].extra_body), **common))
    if burst:
        return _burst(targets[0], work, warmup, timeout, json_out, dataset)
    if compare and targets[1].url == targets[0].url:
        typer.echo("warning: --compare is the --url server: B's prompts reach a prefix cache that A's same prompts "
                   "warmed, which flatters B's first token; compare two servers for latency", err=True)
    rounds = rounds or (2 if compare else 1)
    if rounds > num_requests:
        fail(f"--rounds {rounds} is more than --num-requests {num_requests}")
    per_round = -(-num_requests // rounds)
    if sweep == "concurrency" and max(values) > per_round:
        typer.echo(f"warning: a round has {per_round} requests (--num-requests / --rounds), fewer than "
                   f"--concurrency {max(values):g}: that level cannot fill", err=True)
    plan = Plan(sweep, values, work, rounds, max_concurrency, min(warmup, len(work)), seed, slos, dollars_per_hour,
                preconnect)

    console, err = Console(width=None if Console().is_terminal else 200), Console(stderr=True)
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as progress:
        task = progress.add_task("requests", total=len(values) * len(targets) * num_requests)
        try:
            points = run_sync(targets, plan, timeout, lambda: progress.advance(task), count_tokens)
        except LoadtestError as e:
            fail(str(e))
    results = {
        "schema_version": report.SCHEMA_VERSION, "tool": "unmask loadtest", "started": started,
        "endpoint": targets[0].path, "stream": stream, "sweep": sweep,
        "targets": [{"name": t.name, "url": t.url, "model": t.model, "extra_body": t.extra_body} for t in targets],
        "workload": {"dataset": dataset, "path": str(dataset_path) if dataset_path else None,
                     "input_len": input_len if dataset == "random" else None, "output_len": output_len,
                     "ignore_eos": ignore_eos, "temperature": temperature, "num_requests": num_requests,
                     "rounds": rounds, "max_concurrency": max_concurrency, "seed": seed,
                     "preconnect": preconnect},
        "points": points, "ratios": report.ratios(points, sweep) if compare else [],
    }
    report.print_results(results, console)
    if json_out:
        report.write_json(results, json_out)
        console.print(f"results: {json_out}")
    if plot:
        report.plot(results, plot)
        console.print(f"plots: {plot}")


def _burst(target, work: list, warmup: int, timeout: float, json_out: Optional[Path], dataset: str) -> None:
    import asyncio

    import httpx

    from unmask.loadtest import report
    from unmask.loadtest.burst import run_burst
    from unmask.loadtest.client import send
    from unmask.loadtest.run import LoadtestError, resolve_model

    async def go() -> dict:
        async with httpx.AsyncClient(timeout=timeout) as http:
            await resolve_model(http, target)
            for prompt, max_tokens in work[:warmup]:
                if (await send(http, target, prompt, max_tokens)).error == "connection":
                    raise LoadtestError(f"cannot reach {target.url}")
        return await asyncio.wait_for(run_burst(target, work), timeout)

    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    try:
        result = asyncio.run(go())
    except LoadtestError as e:
        fail(str(e))
    except TimeoutError:
        fail(f"the burst did not end within --timeout {timeout:g} s")
    ms = lambda d: "/".join(report._f(d[k], 0) for k in ("p50", "p90", "p99", "max"))  # noqa: E731
    typer.echo(f"burst of {result['burst']} to {target.url}{target.path}: statuses {result['statuses']}, "
               f"{result['connection_errors']} connection errors, {result['200_complete']} answers complete, "
               f"{result['429_with_retry_after']} 429s with Retry-After, {result['429_envelopes']} with the error "
               f"envelope; to the status line p50/p90/p99/max: 429 {ms(result['429_status_ms'])} ms, "
               f"200 {ms(result['200_status_ms'])} ms; over in {result['wall_s']:.2f} s")
    if json_out:
        report.write_json({"schema_version": report.SCHEMA_VERSION, "tool": "unmask loadtest", "started": started,
                           "endpoint": target.path, "stream": target.stream, "sweep": "burst",
                           "targets": [{"name": target.name, "url": target.url, "model": target.model,
                                        "extra_body": target.extra_body}],
                           "workload": {"dataset": dataset, "num_requests": len(work)}, "burst": result}, json_out)
        typer.echo(f"results: {json_out}")
