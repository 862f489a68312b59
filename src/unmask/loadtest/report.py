"""Output of a run: a rich table on the terminal, the JSON results file and PNG plots of latency percentiles
and throughput against the swept concurrency or rate."""
from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

SCHEMA_VERSION = 1


def _f(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def table(results: dict) -> Table:
    x = results["sweep"]
    t = Table(title=f"unmask loadtest: {results['endpoint']} {'streamed' if results['stream'] else 'not streamed'}")
    cols = ["target", x, "ok/n", "failures", "req/s", "out tok/s", "total tok/s", "TTFT p50/p99 ms",
            "TPOT p50/p99 ms", "ITL p50 ms", "E2E p50/p90/p99 ms"]
    if any("goodput" in p for p in results["points"]):
        cols.append("goodput req/s")
    if any(p.get("cost") for p in results["points"]):
        cols += ["$/1M out", "$/1k req"]
    for c in cols:
        t.add_column(c, justify="left" if c in ("target", "failures") else "right")
    for p in results["points"]:
        fails = ", ".join(f"{k} x{v}" for k, v in p["failures"].items()) or "-"
        row = [p["target"], str(p[x]), f"{p['completed']}/{p['requests']}", fails, _f(p["request_throughput"], 2),
               _f(p["output_throughput"]), _f(p["total_token_throughput"]),
               f"{_f(p['ttft_ms']['p50'])}/{_f(p['ttft_ms']['p99'])}",
               f"{_f(p['tpot_ms']['p50'])}/{_f(p['tpot_ms']['p99'])}", _f(p["itl_ms"]["p50"]),
               "/".join(_f(p["e2el_ms"][k], 0) for k in ("p50", "p90", "p99"))]
        if "goodput req/s" in cols:
            g = p.get("goodput")
            row.append(f"{_f(g['request_throughput'], 2)} ({g['good']}/{p['requests']})" if g else "-")
        if "$/1M out" in cols:
            c = p.get("cost") or {}
            row += [_f(c.get("per_1m_output_tokens"), 3), _f(c.get("per_1k_requests"), 4)]
        t.add_row(*row)
    return t


def print_results(results: dict, console: Console) -> None:
    console.print(table(results))
    for p in results["points"]:
        sm, tc = p.get("server_metrics"), p.get("token_check")
        where = f"{p['target']} {results['sweep']}={p[results['sweep']]}"
        if sm:
            console.print(f"{where}: server /metrics saw {sm['requests']:.0f} completed requests, "
                          f"{sm['output_tokens']:.0f} output tokens, mean E2E {_f(sm['e2el_mean_ms'])} ms, "
                          f"mean time to first chunk {_f(sm.get('ttfc_mean_ms'))} ms (first token "
                          f"{_f(sm['ttft_mean_ms'])} ms), mean step batch {_f(sm['mean_step_batch'], 2)}, "
                          f"tokens/forward {_f(sm['tokens_per_forward'], 2)} (client: {p['completed']}, "
                          f"{p['output_tokens']}, {_f(p['e2el_ms']['mean'])} ms, {_f(p['ttft_ms']['mean'])} ms)")
        if ag := p.get("agreement"):
            own = p.get("client_own_ms") or {}
            console.print(f"{where}: client / server: mean TTFT x{_f(ag['ttft'], 3)} (wire TTFT "
                          f"x{_f(ag.get('wire_ttft'), 3)}; this client's own {_f(own.get('before_write'), 2)} ms "
                          f"before writing, {_f(own.get('after_read'), 2)} ms after reading), mean E2E "
                          f"x{_f(ag['e2el'], 3)}, requests x{_f(ag['requests'], 3)}, output tokens "
                          f"x{_f(ag['output_tokens'], 3)}")
        for kind, detail in p.get("failure_examples", {}).items():
            lat = p.get("failure_latency_ms", {}).get(kind) or {}
            console.print(f"{where}: {kind} x{p['failures'][kind]} in p50/p90/p99/max "
                          f"{'/'.join(_f(lat.get(k), 0) for k in ('p50', 'p90', 'p99', 'max'))} ms, e.g. {detail}",
                          markup=False, highlight=False)
        if p.get("failures_with_retry_after"):
            console.print(f"{where}: {p['failures_with_retry_after']} of {p['failed']} failures carried Retry-After")
        if tc:
            console.print(f"{where}: local tokenizer agrees with usage on {tc['agree']}/{tc['checked']} answers "
                          f"({tc['local_output_tokens']} vs {tc['server_output_tokens']} tokens)")
    for r in results.get("ratios", []):
        x = results["sweep"]
        console.print(f"B/A at {x}={r[x]}: output tok/s x{_f(r['output_throughput'], 3)}, "
                      f"E2E p50 x{_f(r['e2el_p50'], 3)}")


def ratios(points: list[dict], sweep: str) -> list[dict]:
    """B over A per sweep point of a --compare run."""
    out = []
    by = {(p["target"], p[sweep]): p for p in points}
    for (target, x), a in by.items():
        b = by.get(("B", x))
        if target != "A" or b is None:
            continue

        def div(u, v):
            return u / v if u is not None and v else None
        out.append({sweep: x, "output_throughput": div(b["output_throughput"], a["output_throughput"]),
                    "request_throughput": div(b["request_throughput"], a["request_throughput"]),
                    "e2el_p50": div(b["e2el_ms"]["p50"], a["e2el_ms"]["p50"])})
    return out


def _clean(v):
    """JSON without NaN/inf (strict parsers reject them): inf rate -> "inf"."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_clean(x) for x in v]
    return v


def write_json(results: dict, path: Path) -> None:
    path.write_text(json.dumps(_clean(results), indent=2) + "\n")


def plot(results: dict, path: Path) -> None:
    """Four panels against the swept variable, one line per target (and percentile)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = results["sweep"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    panels = [("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("e2el_ms", "end-to-end latency (ms)")]
    targets = sorted({p["target"] for p in results["points"]})
    rate_inf = any(math.isinf(float(p[x])) for p in results["points"])  # float(): "inf" in a JSON file too
    finite = [float(p[x]) for p in results["points"] if not math.isinf(float(p[x]))]
    inf_at = max(finite) * 2 if finite else 1.0

    def xs(pts):
        return [inf_at if math.isinf(float(p[x])) else p[x] for p in pts]

    for ax, (key, label) in zip(axes.flat, panels):
        for i, t in enumerate(targets):  # a colour per target (several), a line style per percentile
            pts = [p for p in results["points"] if p["target"] == t]
            for j, (q, style) in enumerate((("p50", "-"), ("p90", "--"), ("p99", ":"))):
                ys = [p[key][q] for p in pts]
                if any(y is not None for y in ys):
                    ax.plot(xs(pts), [math.nan if y is None else y for y in ys], style, marker="o",
                            color=f"C{i if len(targets) > 1 else j}", label=f"{t} {q}" if len(targets) > 1 else q)
        ax.set_title(label)
    ax = axes.flat[3]
    for i, t in enumerate(targets):
        pts = [p for p in results["points"] if p["target"] == t]
        prefix = f"{t} " if len(targets) > 1 else ""
        ax.plot(xs(pts), [p["output_throughput"] or 0 for p in pts], marker="o", color=f"C{i}",
                label=f"{prefix}output tok/s")
        ax.plot(xs(pts), [p["total_token_throughput"] or 0 for p in pts], "--", marker="o",
                color=f"C{i if len(targets) > 1 else 1}", label=f"{prefix}total tok/s")
    ax.set_title("throughput (tokens/s)")
    for ax in axes.flat:
        ax.set_xlabel(x + (" (rightmost: inf)" if rate_inf else ""))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    names = ", ".join(f"{t['name']}: {t['url']} ({t['model']})" for t in results["targets"])
    fig.suptitle(f"unmask loadtest, {results['endpoint']}, {names}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
