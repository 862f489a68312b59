"""The PNG plots of docs/benchmarks.md (matplotlib, imported only when a plot is drawn): speed vs quality per
policy, cost growth with prompt and output length, batch scaling. The text around them is report.py's."""
from __future__ import annotations

import math
from pathlib import Path

from .common import with_long_prefill


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_pareto(sec: dict, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    pts = []
    for name in sec["order"]:
        v = sec["variants"][name]
        tps = v["tokens_per_s"]
        if not tps["median"]:  # nothing generated: no place on a log axis
            continue
        x, y = tps["median"], v["accuracy"]
        xerr = [[x - tps["min"]], [tps["max"] - x]]
        yerr = [[y - v["ci95"][0]], [v["ci95"][1] - y]]
        twin = v["group"] == "twin"
        color = {"twin": "tab:red", "distilled": "tab:green"}.get(v["group"], "tab:blue")
        ax.errorbar(x, 100 * y, xerr=xerr, yerr=[[100 * e for e in yerr[0]], [100 * e for e in yerr[1]]],
                    fmt="s" if twin else "o", color=color, ecolor="0.75", capsize=2, ms=6)
        ax.annotate(name, (x, 100 * y), textcoords="offset points", xytext=(5, 4 + 9 * (len(pts) % 3)), fontsize=7)
        pts.append((x, y, name))
    front = []
    for x, y, n in sorted(pts, key=lambda p: -p[0]):
        if not front or y > front[-1][1]:
            front.append((x, y, n))
    if len(front) > 1:
        ax.plot([p[0] for p in front], [100 * p[1] for p in front], "--", color="0.5", lw=1, label="Pareto frontier")
        ax.legend(loc="best", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("tokens/s (batch 1; median, bars min–max over rounds)")
    ax.set_ylabel("held-out exact match, % (bars: 95% Wilson)")
    ax.set_title("Accuracy vs speed per decoding policy (blue: unmask, green: distilled, red: AR twin)",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plain_log_ticks(*axes) -> None:
    from matplotlib.ticker import FuncFormatter

    fmt = FuncFormatter(lambda v, _: f"{v:g}")
    for ax in axes:
        ax.yaxis.set_major_formatter(fmt)
        ax.yaxis.set_minor_formatter(fmt)
        ax.tick_params(axis="y", which="minor", labelsize=7)


def _fit_line(ax, xs, fit, style, label, color=None):
    if fit and fit.get("slope") is not None and len(xs) >= 2:
        s, b = fit["slope"], fit["intercept"]
        ax.plot(xs, [math.exp(b) * x ** s for x in xs], style, lw=1, color=color, label=f"{label}: slope {s:.2f}")


def plot_cost(sec: dict, path_prompt: Path, path_gen: Path, long: dict | None = None) -> None:
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    ctx, pre = sec["context"], with_long_prefill(sec["prefill"], long)
    for curve, key, mark, col, lbl in ((ctx, "s_per_token", "o", "tab:blue", "decode ms/token (tiled cache)"),
                                       (pre, "s_per_token", "^", "tab:orange", "decode ms/token (after real prefill)"),
                                       (pre, "prefill_s", "s", "tab:green", "prefill, ms per request")):
        xs = [r["length"] for r in curve["rows"]]
        ys = [1e3 * r[key]["median"] if r[key]["median"] else None for r in curve["rows"]]
        a1.plot(xs, ys, mark, color=col, label=lbl)
        f = dict(curve["fits"][key])
        if f.get("intercept") is not None:
            f["intercept"] += math.log(1e3)
        _fit_line(a1, xs, f, {"o": "-", "^": ":", "s": "--"}[mark], "fit", col)
    a1.set_xscale("log", base=2)
    a1.set_yscale("log")
    a1.set_xlabel("prompt tokens")
    a1.set_ylabel("milliseconds")
    a1.set_title("Time vs prompt length (median of rounds)", fontsize=10)
    a1.grid(True, which="both", alpha=0.3)
    a1.legend(fontsize=7)
    for curve, mark, col, lbl in ((ctx, "o", "tab:blue", "peak RSS growth (tiled cache)"),
                                  (pre, "^", "tab:orange", "peak RSS growth (real prefill)")):
        xs = [r["length"] for r in curve["rows"]]
        ys = [r["delta_mb"]["median"] for r in curve["rows"]]
        a2.plot(xs, ys, mark, color=col, label=lbl)
        _fit_line(a2, xs, curve["fits"]["delta_mb"], "-" if mark == "o" else ":", "fit", col)
    xs = [r["length"] for r in ctx["rows"]]
    a2.plot(xs, [r["kv_cache_mb"] for r in ctx["rows"]], "k--", lw=1, label="KV cache size (computed)")
    a2.set_xscale("log", base=2)
    a2.set_yscale("log")
    a2.set_xlabel("prompt tokens")
    a2.set_ylabel("MB")
    a2.set_title("Peak memory growth per request", fontsize=10)
    a2.grid(True, which="both", alpha=0.3)
    a2.legend(fontsize=7)
    _plain_log_ticks(a1, a2)
    fig.tight_layout()
    fig.savefig(path_prompt, dpi=110)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    g = sec["generate"]
    xs = [r["length"] for r in g["rows"]]
    a1.plot(xs, [1e3 * r["s_per_token"]["median"] for r in g["rows"]], "o", label="ms per generated token")
    lo = [1e3 * r["s_per_token"]["min"] for r in g["rows"]]
    hi = [1e3 * r["s_per_token"]["max"] for r in g["rows"]]
    a1.fill_between(xs, lo, hi, alpha=0.2)
    f = dict(g["fits"]["s_per_token"])
    if f.get("intercept") is not None:
        f["intercept"] += math.log(1e3)
    _fit_line(a1, xs, f, "-", "fit")
    a1.set_xscale("log", base=2)
    a1.set_yscale("log")
    a1.set_xlabel("generated tokens")
    a1.set_ylabel("ms per token")
    a1.set_title("Time per generated token vs generation length", fontsize=10)
    a1.grid(True, which="both", alpha=0.3)
    a1.legend(fontsize=8)
    a2.plot(xs, [r["delta_mb"]["median"] for r in g["rows"]], "o", label="peak RSS growth")
    _fit_line(a2, xs, g["fits"]["delta_mb"], "-", "fit")
    a2.plot(xs, [r["kv_cache_mb"] for r in g["rows"]], "k--", lw=1, label="KV cache size (computed)")
    a2.set_xscale("log", base=2)
    a2.set_yscale("log")
    a2.set_xlabel("generated tokens")
    a2.set_ylabel("MB")
    a2.set_title("Peak memory growth per request", fontsize=10)
    a2.grid(True, which="both", alpha=0.3)
    a2.legend(fontsize=8)
    _plain_log_ticks(a1, a2)
    fig.tight_layout()
    fig.savefig(path_gen, dpi=110)
    plt.close(fig)


def plot_batch(sec: dict, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["batch"] for r in sec["rows"]]
    t = [r["tokens_per_s"] for r in sec["rows"]]
    ax.errorbar(xs, [s["median"] for s in t], yerr=[[s["median"] - s["min"] for s in t], [s["max"] - s["median"] for s in t]],
                fmt="o-", capsize=3)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.set_xlabel("batch size (requests per generate call)")
    ax.set_ylabel("generated tokens/s")
    ax.set_title("Offline API throughput vs batch size", fontsize=10)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
