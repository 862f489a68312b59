"""Long prefill: where the time goes, what the CPU settings change, and time to first token against the AR twin.

Three modes over held-out corpus tokens (repeated where a length needs more), the engine directly (no tokenizer,
batch 1, prefix cache off), lengths past the model's trained context with the limit raised (RoPE positions are
computed on the fly: the cost is the real one, the text is not meaningful):

  profile  one chunked prefill of each length under torch.profiler, every layer's attention call marked
           (record_function "attention" around models.attention.ragged_attention: the cache write, the read in
           the compute dtype, the flash calls and their merge). Reported: the prefill's wall time, the share of
           the profiled step time inside attention, in the linear layers (aten::addmm / mm self time outside
           attention) and in the rest, and the top operators by self time.
  tune     prefill seconds (the chunk steps until the prompt is in the cache) for a base setting and one change at a
           time: chunk (max_batch_tokens), threads, dtype, the split attention path off, the token-causal path off
           (prompt chunks of a causal-context model attended through the masked calls instead of the kernels'
           causal rule), RMSNorm and RoPE as written before the fused kernel (--plain-layers); interleaved per
           round (order rotated), per-round ratios against the base.
  prepare  Segment.prepare of one causal-context prompt chunk per length (seconds, peak RSS growth), this version
           against another attention.py (--attention FILE), interleaved.
  layers   the RMSNorms and RoPE of one forward over a --chunk-row chunk: as the library has them ("fused"), as
           before ("plain") and with torch's F.rms_norm (the CUDA branch), interleaved.
  ttft     time to first token against prompt length, unmask and the AR twin in the same process, interleaved per
           round: unmask = add_request until the first answer token is committed (prefill chunks + the first
           decode step; topk policy, one token per forward, as bench/benchlib/cost.py; `--policy default`: the
           model's own); the twin = transformers `generate(max_new_tokens=1)` (greedy) from the same token ids.
           Same dtype, same threads.

    python bench/prefill_cost.py profile --lengths 8192,32768
    python bench/prefill_cost.py tune --lengths 8192 --chunks 2048,8192 --threads-list 1 --dtypes bfloat16 \
        --split-off --causal-off --rounds 2
    python bench/prefill_cost.py ttft --lengths 1024,2048,4096,8192,16384,32768 --rounds 2 [--policy default]
    python bench/prefill_cost.py layers --chunk 4096 --threads 1 --rounds 15 [--dtype bfloat16]
    git show 02f6105:src/unmask/models/attention.py > /tmp/attention-02f6105.py
    python bench/prefill_cost.py prepare --lengths 4096,32768 --attention /tmp/attention-02f6105.py --rounds 3
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "src"))

from benchlib.common import ratio_summary, rotated, summary, write_json  # noqa: E402
from benchlib.cost import corpus_ids  # noqa: E402
from unmask.engine.engine import Engine  # noqa: E402
from unmask.engine.params import GenerationParams  # noqa: E402
from unmask.models import attention, layers, transformer  # noqa: E402
from unmask.models.loader import load_model  # noqa: E402
from unmask.tokenizer import Tokenizer  # noqa: E402

MODEL = ROOT / "bench/models/unmask-tiny-5m"
TWIN = ROOT / "bench/models/ar-twin"


def load(model_dir: str, dtype: str, max_len: int):
    model, spec = load_model(model_dir, dtype=dtype)
    limit = max(spec.max_context, max_len)
    return model, dataclasses.replace(spec, arch=dataclasses.replace(spec.arch, max_position=limit))


def first_token(model, spec, ids: list[int], chunk: int, policy: str = "topk") -> dict:
    """Engine prefill of `ids` and its first answer token: prefill seconds (the steps that feed prompt chunks) and
    the time to the first committed token. policy "topk": one token per forward; "default": the model's own
    (generation_config.json `default_policy`: the built-in family's is `speculative`)."""
    eng = Engine(model, spec, None, max_num_seqs=1, max_batch_tokens=chunk, prefix_cache_bytes=0)
    knobs = dict(policy="topk", tokens_per_step=1) if policy == "topk" else {}
    params = GenerationParams(max_tokens=spec.block_size, ignore_eos=True, **knobs)
    with torch.no_grad():
        t0 = time.perf_counter()
        seq = eng.add_request(ids, params)
        prefill = 0.0
        while seq.num_generated == 0:
            fed, s0 = eng.stats.tokens_fed, time.perf_counter()
            eng.step()
            if eng.stats.tokens_fed - fed > 2 * seq.B:
                prefill += time.perf_counter() - s0
        ttft = time.perf_counter() - t0
    return {"prefill_s": prefill, "ttft_s": ttft}


# ---- the shared layers as written before the fused RMSNorm and the in-place RoPE (layers.py at 02f6105), kept
# here as the A/B reference of `tune --plain-layers`


def _plain_norm(self, x):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
    return self.weight * xf.to(x.dtype)


def _plain_cos_sin(self, positions):
    if self.inv_freq.device != positions.device:
        self.inv_freq = self.inv_freq.to(positions.device)
    freqs = positions.float()[..., None] * self.inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * self.mscale, emb.sin() * self.mscale


def _plain_apply(self, x, cos, sin):
    r = self.rotary_dim
    xr = x[..., :r].float()
    half = r // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    out = (xr * cos[..., None, :] + rotated * sin[..., None, :]).to(x.dtype)
    return out if r == x.shape[-1] else torch.cat([out, x[..., r:]], dim=-1)


def _torch_norm(self, x):  # torch's F.rms_norm, as the library calls it on CUDA
    return self.weight * torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=self.eps).to(x.dtype)


_LAYERS = {"fused": (layers.RMSNorm.forward, layers.Rotary.cos_sin, layers.Rotary.apply),
           "plain": (_plain_norm, _plain_cos_sin, _plain_apply),
           "torch-norm": (_torch_norm, layers.Rotary.cos_sin, layers.Rotary.apply)}


def use_layers(kind: str) -> None:
    """RMSNorm and RoPE as the library has them ("fused") or as before ("plain")."""
    layers.RMSNorm.forward, layers.Rotary.cos_sin, layers.Rotary.apply = _LAYERS[kind]


@contextlib.contextmanager
def marked_attention():
    """record_function("attention") around every layer's attention call (transformer.py's module-level name)."""
    from torch.profiler import record_function

    plain = transformer.ragged_attention

    def marked(*a, **k):
        with record_function("attention"):
            return plain(*a, **k)

    transformer.ragged_attention = marked
    try:
        yield
    finally:
        transformer.ragged_attention = plain


def profile(args) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    lengths = [int(x) for x in args.lengths.split(",")]
    model, spec = load(args.model, args.dtype, max(lengths) + 64)
    ids = corpus_ids(Tokenizer(args.model), args.corpus, max(lengths))
    use_layers("plain" if args.plain_layers else "fused")
    first_token(model, spec, ids[:1024], args.chunk)  # warm-up
    out = {}
    for L in lengths:
        with marked_attention(), torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            run = first_token(model, spec, ids[:L], args.chunk)
        ev = {e.key: e for e in prof.key_averages()}
        att = ev["attention"].cpu_time_total / 1e6
        # linear layers: matrix products outside attention (attention's kernels are flash ops, not addmm/mm)
        linear = sum(ev[k].self_cpu_time_total for k in ("aten::addmm", "aten::mm") if k in ev) / 1e6
        total = sum(e.self_cpu_time_total for e in ev.values() if e.key != "attention") / 1e6
        top = sorted((e for e in ev.values() if e.key != "attention"), key=lambda e: -e.self_cpu_time_total)[:10]
        row = {"length": L, "ttft_s": run["ttft_s"], "prefill_s": run["prefill_s"], "profiled_s": total,
               "attention_s": att, "linear_s": linear, "rest_s": total - att - linear,
               "top_self_s": {e.key: e.self_cpu_time_total / 1e6 for e in top}}
        out[L] = row
        print(f"L={L}: TTFT {run['ttft_s']:.2f} s (prefill {run['prefill_s']:.2f} s; {total:.2f} s profiled): "
              f"attention {att:.2f} s ({att / total:.0%}), linear {linear:.2f} s ({linear / total:.0%}), "
              f"rest {total - att - linear:.2f} s ({(total - att - linear) / total:.0%})", flush=True)
        print("   top self time: " + ", ".join(f"{k} {v:.2f}" for k, v in row["top_self_s"].items()), flush=True)
    return out


def tune(args) -> dict:
    lengths = [int(x) for x in args.lengths.split(",")]
    ids = corpus_ids(Tokenizer(args.model), args.corpus, max(lengths))
    models = {d: load(args.model, d, max(lengths) + 64) for d in {args.dtype, *args.dtypes.split(",")} if d}
    base = {"chunk": args.chunk, "threads": args.threads, "dtype": args.dtype, "split": True, "causal": True,
            "layers": "fused"}
    variants = [("base", base)]
    variants += [(f"chunk={c}", {**base, "chunk": int(c)}) for c in args.chunks.split(",") if c]
    variants += [(f"threads={t}", {**base, "threads": int(t)}) for t in args.threads_list.split(",") if t]
    variants += [(f"dtype={d}", {**base, "dtype": d}) for d in args.dtypes.split(",") if d]
    if args.split_off:
        variants.append(("split=off", {**base, "split": False}))
    if args.causal_off:
        variants.append(("causal=off", {**base, "causal": False}))
    if args.plain_layers:
        variants.append(("layers=plain", {**base, "layers": "plain"}))
    default_split, causal_path = attention.SPLIT_MIN_ELEMENTS, attention._attend_causal
    runs: dict[tuple[int, str], list[dict]] = {}
    for r in range(args.rounds):
        for L in lengths:
            for name, v in rotated(variants, r):
                torch.set_num_threads(v["threads"])
                attention.SPLIT_MIN_ELEMENTS = default_split if v["split"] else 1 << 62
                attention._attend_causal = causal_path if v["causal"] else (lambda *a: None)
                use_layers(v["layers"])
                model, spec = models[v["dtype"]]
                res = first_token(model, spec, ids[:L], v["chunk"])
                runs.setdefault((L, name), []).append(res)
                print(f"round {r} L={L} {name}: prefill {res['prefill_s']:.2f} s, TTFT {res['ttft_s']:.2f} s",
                      flush=True)
    attention.SPLIT_MIN_ELEMENTS, attention._attend_causal = default_split, causal_path
    use_layers("fused")
    torch.set_num_threads(args.threads)
    out = {}
    for L in lengths:
        b = [x["prefill_s"] for x in runs[(L, "base")]]
        for name, _ in variants:
            p = [x["prefill_s"] for x in runs[(L, name)]]
            ratio = ratio_summary(b, p)  # > 1: the variant is faster than the base
            out[f"{L}/{name}"] = {"prefill_s": summary(p), "speedup_vs_base": ratio}
            print(f"L={L} {name}: prefill median {statistics.median(p):.2f} s [{min(p):.2f}-{max(p):.2f}], "
                  f"base/variant {ratio['median']:.2f}x [{ratio['min']:.2f}-{ratio['max']:.2f}]")
    return out


def layer_cost(args) -> dict:
    """The RMSNorms and RoPE of one forward over a chunk of --chunk rows (every norm module of the model on its
    input's shape, then per layer cos/sin and the q and k rotations), each layers kind, interleaved."""
    model = load(args.model, args.dtype, args.chunk)[0]
    a = model.cfg
    n, dt = args.chunk, model.lm_head.weight.dtype
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, a.hidden_size, generator=g).to(dt)
    q, k = (torch.randn(n, h, a.head_dim, generator=g).to(dt) for h in (a.num_heads, a.num_kv_heads))
    norms = [m for m in model.modules() if isinstance(m, layers.RMSNorm)]
    pos = torch.arange(n)

    def forward() -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            for m in norms:
                m(x) if m.weight.numel() == a.hidden_size else (m(q), m(k))
            for _ in range(a.num_layers):
                c, s = model.rope.cos_sin(pos)
                model.rope.apply(q, c, s), model.rope.apply(k, c, s)
        return time.perf_counter() - t0

    kinds = ["plain", "fused", "torch-norm"]
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for r in range(args.rounds):
        for kind in rotated(kinds, r):
            use_layers(kind)
            times[kind].append(forward())
    use_layers("fused")
    out = {kind: {"seconds": summary(v), "plain_over_this": ratio_summary(times["plain"], v)}
           for kind, v in times.items()}
    for kind, v in out.items():
        print(f"{kind}: {v['seconds']['median'] * 1e3:.1f} ms per forward ({len(norms)} norms, {a.num_layers} "
              f"layers of RoPE, {n} rows, {dt}); plain / this per round {v['plain_over_this']['median']:.2f}x "
              f"[{v['plain_over_this']['min']:.2f}-{v['plain_over_this']['max']:.2f}]")
    return out


def load_attention(path: str):
    """Another version of models/attention.py (e.g. `git show REV:src/unmask/models/attention.py > FILE`)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("attention_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def prepare(args) -> dict:
    """Segment.prepare of one causal-context prompt chunk (block ids = positions): seconds and peak RSS growth,
    this version against --attention FILE, interleaved."""
    from benchlib.common import PeakMemory

    versions = {"current": attention, **({"file": load_attention(args.attention)} if args.attention else {})}
    mem, runs = PeakMemory(), {}
    for r in range(args.rounds):
        for L in (int(x) for x in args.lengths.split(",")):
            for name in rotated(list(versions), r):
                mem.start()
                t0 = time.perf_counter()
                seg = versions[name].Segment(start=0, length=L, block_ids=torch.arange(L))
                seg.prepare()
                row = {"seconds": time.perf_counter() - t0, **mem.stop()}
                del seg
                runs.setdefault(f"{L}/{name}", []).append(row)
                print(f"round {r} L={L} {name}: prepare {row['seconds'] * 1e3:.1f} ms, peak RSS growth "
                      f"{row['delta_mb']:.0f} MB", flush=True)
    return {k: {"seconds": summary([x["seconds"] for x in v]), "delta_mb": summary([x["delta_mb"] for x in v])}
            for k, v in runs.items()}


def twin_first_token(twin, ids: list[int]) -> dict:
    x = torch.tensor([ids])
    with torch.no_grad():
        t0 = time.perf_counter()
        twin.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=1, do_sample=False, pad_token_id=0)
        return {"ttft_s": time.perf_counter() - t0}


def ttft(args) -> dict:
    from transformers import AutoModelForCausalLM

    lengths = [int(x) for x in args.lengths.split(",")]
    model, spec = load(args.model, args.dtype, max(lengths) + 64)
    twin = AutoModelForCausalLM.from_pretrained(args.twin, dtype=getattr(torch, args.dtype),
                                                attn_implementation="sdpa").eval()
    ids = corpus_ids(Tokenizer(args.model), args.corpus, max(lengths))  # the twin shares the tokenizer
    runners = {"unmask": lambda L: first_token(model, spec, ids[:L], args.chunk, args.policy),
               "ar-twin": lambda L: twin_first_token(twin, ids[:L])}
    for run in runners.values():
        run(1024)  # warm-up
    runs: dict[tuple[int, str], list[float]] = {}
    for r in range(args.rounds):
        for L in rotated(lengths, r):
            for name in rotated(list(runners), r + L):
                t = runners[name](L)["ttft_s"]
                runs.setdefault((L, name), []).append(t)
                print(f"round {r} L={L} {name}: TTFT {t:.2f} s", flush=True)
    out = {}
    for L in lengths:
        u, a = runs[(L, "unmask")], runs[(L, "ar-twin")]
        ratio = ratio_summary(u, a)
        out[L] = {"unmask_s": summary(u), "ar_twin_s": summary(a), "unmask_over_twin": ratio}
        print(f"L={L}: unmask {statistics.median(u):.2f} s, AR twin {statistics.median(a):.2f} s, "
              f"unmask/twin {ratio['median']:.2f}x [{ratio['min']:.2f}-{ratio['max']:.2f}]")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("profile", "tune", "ttft", "prepare", "layers"))
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--twin", default=str(TWIN))
    ap.add_argument("--corpus", default=str(ROOT / "data/corpus/heldout.jsonl"))
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--dtype", default="float32", help="the base dtype (and the twin's in ttft)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=4096, help="max_batch_tokens: the prefill chunk (engine default)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--chunks", default="", help="tune: other chunk sizes")
    ap.add_argument("--threads-list", default="", help="tune: other thread counts")
    ap.add_argument("--dtypes", default="", help="tune: other dtypes")
    ap.add_argument("--split-off", action="store_true", help="tune: also the split attention path off")
    ap.add_argument("--causal-off", action="store_true", help="tune: also the token-causal path off")
    ap.add_argument("--plain-layers", action="store_true",
                    help="tune: also RMSNorm and RoPE as written before the fused kernel (the A/B of that change); "
                         "profile: run with them")
    ap.add_argument("--attention", default=None, help="prepare: another models/attention.py to compare")
    ap.add_argument("--policy", default="topk", choices=("topk", "default"),
                    help="ttft: unmask's decoding policy (topk: one token per forward; default: the model's own)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = {"profile": profile, "tune": tune, "ttft": ttft, "prepare": prepare, "layers": layer_cost}[args.mode](args)
    if args.json:
        write_json(args.json, {"args": vars(args), "results": out})


if __name__ == "__main__":
    main()
