"""DiffusionGemma: unmask's engine against transformers' reference `generate`, interleaved A/B.

    python bench/diffusion_gemma.py --make-tiny /tmp/dgemma          # build a tiny random checkpoint first
    python bench/diffusion_gemma.py --model /tmp/dgemma [--mode sequential|concurrent|both] [--reps 5]

Same checkpoint, same prompts, same settings; the two systems alternate (A B, B A, ...) so that a loaded
machine slows both alike. Modes:
  sequential  one request at a time: reference `generate` on a batch of 1, unmask with one request in
              the engine; both draw from a generator seeded alike, so the outputs are token-identical
              (checked) and do the same number of denoising steps.
  concurrent  all prompts at once: the reference's batched `generate` (left-padded, lockstep rows) and
              unmask with every request submitted together (continuous batching). Randomness differs
              between the two (the reference shares one RNG across rows), so tokens are not compared.
tokens/s counts generated tokens (up to each request's max_new_tokens, or the first EOS). Prints a table,
then one JSON line with the median / min / max of the per-round ratio unmask / reference.
--draws lean lets unmask draw only the random numbers it uses (same output distribution, not the
reference's stream); --mixed-lengths gives requests different budgets, as a server sees them.
  staggered   unmask alone, CUDA graphs on against off (UNMASK_CUDA_GRAPHS), requests arriving one every
              --stagger engine steps, so the batch's make-up keeps changing (a server's load); no reference.
--device cuda runs both on a GPU (timings end with a device synchronise); a larger random checkpoint for it:
    python bench/diffusion_gemma.py --make-tiny /tmp/dg-mid --hidden 1024 --layers 8 --vocab 32768
    python bench/diffusion_gemma.py --model /tmp/dg-mid --device cuda --dtype bfloat16 --reps 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def make_tiny(out: Path, hidden: int = 64, layers: int = 3, vocab: int = 512, canvas: int = 16,
              seed: int = 0) -> Path:
    """A random text-only-served checkpoint from transformers' own classes (families.md 6.6 recipe)."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
    from transformers.models.diffusion_gemma import DiffusionGemmaTextConfig

    types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
    text = DiffusionGemmaTextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, num_experts=4, top_k_experts=2,
        moe_intermediate_size=hidden // 2, sliding_window=32, layer_types=types, global_head_dim=hidden // 2,
        num_global_key_value_heads=1)
    vision = dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=16, position_embedding_size=64,
                  patch_size=16)
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig(text_config=text, vision_config=vision,
                                                                 canvas_length=canvas))
    with torch.no_grad():  # peaked logits, as a trained model has: canvases accept several tokens per step
        model.model.decoder.embed_tokens.weight.normal_(0, 1.0)
    model.save_pretrained(out)
    return out


def prompts_for(n: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lens]


def count(tokens: list[int], eos: int | None, limit: int) -> int:
    tokens = tokens[:limit]
    return tokens.index(eos) if eos is not None and eos in tokens else len(tokens)


def budgets_for(a, n: int) -> list[int]:
    """max_new_tokens per request: all equal, or (--mixed-lengths) 1/4, 2/4, 3/4, 4/4 of --max-new-tokens."""
    if not a.mixed_lengths:
        return [a.max_new_tokens] * n
    return [max(1, round(a.max_new_tokens * (i % 4 + 1) / 4)) for i in range(n)]


def ref_kwargs(a, max_new: int) -> dict:
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    kw = dict(max_new_tokens=max_new, max_denoising_steps=a.steps, t_min=a.t_min, t_max=a.t_max,
              sampler_config=EntropyBoundSamplerConfig(entropy_bound=a.entropy_bound),
              stability_threshold=a.stability_threshold, confidence_threshold=a.confidence_threshold)
    if a.eos is not None:
        kw.update(eos_token_id=a.eos, pad_token_id=0)
    return kw


def unmask_params(a, seed: int, max_new: int):
    from unmask.engine.params import GenerationParams

    return GenerationParams(max_tokens=max_new, steps=a.steps, seed=seed, t_min=a.t_min, t_max=a.t_max,
                            entropy_bound=a.entropy_bound, stability_threshold=a.stability_threshold,
                            confidence_threshold=a.confidence_threshold, uniform_draws=a.draws,
                            stop_token_ids=[a.eos] if a.eos is not None else [])


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def run_reference(ref, prompts, budgets, a, mode: str) -> tuple[float, int, list[list[int]]]:
    dev = a.device
    synchronize(dev)
    t0 = time.perf_counter()
    outs = []
    if mode == "sequential":
        for i, (p, n) in enumerate(zip(prompts, budgets)):
            torch.manual_seed(a.seed + i)
            seq = ref.generate(torch.tensor([p], device=dev), **ref_kwargs(a, n)).sequences[0, len(p):].tolist()
            outs.append(seq)
    else:  # one left-padded batch, run to the largest budget (one max_new_tokens per call)
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=dev)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)
        torch.manual_seed(a.seed)
        out = ref.generate(ids, attention_mask=mask, **ref_kwargs(a, max(budgets))).sequences[:, width:]
        outs = out.tolist()
    synchronize(dev)
    wall = time.perf_counter() - t0
    return wall, sum(count(o, a.eos, n) for o, n in zip(outs, budgets)), outs


def run_unmask(model, spec, prompts, budgets, a, mode: str) -> tuple[float, int, list[list[int]], int]:
    from unmask.engine.engine import Engine

    eng = Engine(model, spec, max_num_seqs=max(len(prompts), 1))
    synchronize(a.device)
    t0 = time.perf_counter()
    outs = []
    if mode == "sequential":
        for i, (p, n) in enumerate(zip(prompts, budgets)):
            seq = eng.add_request(p, unmask_params(a, a.seed + i, n))
            eng.run_to_completion()
            outs.append(seq.output_ids)
    else:
        seqs = [eng.add_request(p, unmask_params(a, a.seed + i, n))
                for i, (p, n) in enumerate(zip(prompts, budgets))]
        eng.run_to_completion()
        outs = [s.output_ids for s in seqs]
    synchronize(a.device)
    wall = time.perf_counter() - t0
    return wall, sum(len(o) for o in outs), outs, eng.stats.steps


def run_staggered(model, spec, prompts, budgets, a) -> tuple[float, int, int]:
    """unmask alone, requests arriving one every --stagger engine steps (a server's staggered load): the batch's
    make-up changes as they come and go. Returns (wall seconds, tokens, steps)."""
    from unmask.engine.engine import Engine

    eng = Engine(model, spec, max_num_seqs=max(len(prompts), 1))
    synchronize(a.device)
    t0 = time.perf_counter()
    seqs, i = [], 0
    while i < len(prompts) or eng.has_unfinished():
        if i < len(prompts) and eng.stats.steps >= i * a.stagger:
            seqs.append(eng.add_request(prompts[i], unmask_params(a, a.seed + i, budgets[i])))
            i += 1
            continue
        eng.step()
    synchronize(a.device)
    return time.perf_counter() - t0, sum(len(s.output_ids) for s in seqs), eng.stats.steps


def bench_staggered(model, spec, prompts, a) -> dict:
    """Rounds of run_staggered with CUDA graphs on and off (UNMASK_CUDA_GRAPHS read per engine), interleaved."""
    import os

    budgets = budgets_for(a, len(prompts))
    rounds = []
    for r in range(a.reps + 1):  # round 0 warms both up and is not counted
        res = {}
        for graphs in (("1", "0") if r % 2 == 0 else ("0", "1")):
            os.environ["UNMASK_CUDA_GRAPHS"] = graphs
            res[graphs] = run_staggered(model, spec, prompts, budgets, a)
        if r:
            (gw, gt, _), (ew, et, steps) = res["1"], res["0"]
            rounds.append({"graphs_tps": gt / gw, "eager_tps": et / ew, "ratio": (gt / gw) / (et / ew), "steps": steps})
    os.environ.pop("UNMASK_CUDA_GRAPHS", None)
    ratios = [x["ratio"] for x in rounds]
    return {"mode": "staggered", "requests": len(prompts), "stagger": a.stagger,
            "graphs_tps": statistics.median(x["graphs_tps"] for x in rounds),
            "eager_tps": statistics.median(x["eager_tps"] for x in rounds),
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


def bench_mode(ref, model, spec, prompts, a, mode: str) -> dict:
    budgets = budgets_for(a, len(prompts))
    run_reference(ref, prompts[:1], budgets[:1], a, mode)  # warm-up (first-call allocations, lazy init)
    run_unmask(model, spec, prompts[:1], budgets[:1], a, mode)
    rounds = []
    identical = True
    for r in range(a.reps):
        order = ("ref", "unmask") if r % 2 == 0 else ("unmask", "ref")
        res = {}
        for who in order:
            if who == "ref":
                res["ref"] = run_reference(ref, prompts, budgets, a, mode)
            else:
                res["unmask"] = run_unmask(model, spec, prompts, budgets, a, mode)
        (rw, rt, routs), (uw, ut, uouts, steps) = res["ref"], res["unmask"]
        if mode == "sequential" and a.draws == "reference":
            identical &= all(u == o[:len(u)] and len(u) == count(o, a.eos, n)
                             for u, o, n in zip(uouts, routs, budgets))
        rounds.append({"ref_tps": rt / rw, "unmask_tps": ut / uw, "ratio": (ut / uw) / (rt / rw),
                       "ref_tokens": rt, "unmask_tokens": ut, "unmask_steps": steps})
    ratios = [x["ratio"] for x in rounds]
    return {
        "mode": mode, "requests": len(prompts),
        "identical": identical if mode == "sequential" and a.draws == "reference" else None,
        "ref_tps": statistics.median(x["ref_tps"] for x in rounds),
        "unmask_tps": statistics.median(x["unmask_tps"] for x in rounds),
        "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "rounds": rounds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--make-tiny", type=Path, help="write a tiny random checkpoint here and exit")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--canvas", type=int, default=16)
    ap.add_argument("--mode", choices=("sequential", "concurrent", "both", "staggered"), default="both",
                    help="staggered: unmask alone with CUDA graphs on vs off, requests arriving every --stagger steps")
    ap.add_argument("--stagger", type=int, default=3, help="staggered mode: engine steps between arrivals")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", default="8,64", help="min,max prompt tokens")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--mixed-lengths", action="store_true",
                    help="requests ask for 1/4..4/4 of --max-new-tokens (the reference's batch runs to the max)")
    ap.add_argument("--steps", type=int, default=16, help="max denoising steps per canvas")
    ap.add_argument("--entropy-bound", type=float, default=0.1)
    ap.add_argument("--t-min", type=float, default=0.4)
    ap.add_argument("--t-max", type=float, default=0.8)
    ap.add_argument("--stability-threshold", type=int, default=1)
    ap.add_argument("--confidence-threshold", type=float, default=0.005)
    ap.add_argument("--eos", type=int, default=None, help="stop token (default: none, full length)")
    ap.add_argument("--draws", choices=("reference", "lean"), default="reference",
                    help="unmask's random stream: the reference's (token-identical) or only the used draws")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.make_tiny:
        print(make_tiny(a.make_tiny, a.hidden, a.layers, a.vocab, a.canvas, a.seed))
        return
    if a.model is None:
        ap.error("--model or --make-tiny is required")

    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.utils import logging as hf_logging

    from unmask.models.loader import load_model

    hf_logging.set_verbosity_error()
    model, spec = load_model(a.model, dtype=a.dtype, device=a.device)
    lo, hi = (int(x) for x in a.prompt_len.split(","))
    prompts = prompts_for(a.requests, spec.arch.vocab_size, lo, hi, a.seed)
    if a.mode == "staggered":
        r = bench_staggered(model, spec, prompts, a)
        if not str(a.device).startswith("cuda"):
            print("note: CUDA graphs exist on CUDA only; both sides ran eagerly here")
        print(f"staggered: {a.requests} requests, one every {a.stagger} steps, device={a.device} dtype={a.dtype}: "
              f"graphs {r['graphs_tps']:.1f} tok/s, eager {r['eager_tps']:.1f} tok/s, ratio {r['ratio_median']:.2f} "
              f"[{r['ratio_min']:.2f}-{r['ratio_max']:.2f}]")
        print(json.dumps({"bench": "diffusion_gemma", "model": a.model.name, "device": a.device, "dtype": a.dtype,
                          "max_new_tokens": a.max_new_tokens, "results": [r]}))
        return
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    ref = DiffusionGemmaForBlockDiffusion.from_pretrained(a.model, dtype=dtype).to(a.device).eval()
    modes = ("sequential", "concurrent") if a.mode == "both" else (a.mode,)
    results = [bench_mode(ref, model, spec, prompts, a, m) for m in modes]

    print(f"model={a.model.name} canvas={spec.block_size} requests={a.requests} max_new={a.max_new_tokens} "
          f"steps={a.steps} draws={a.draws} mixed_lengths={a.mixed_lengths} threads={a.threads} dtype={a.dtype} "
          f"device={a.device} "
          f"reps={a.reps}")
    print(f"{'mode':<11} {'ref tok/s':>10} {'unmask tok/s':>13} {'ratio med':>10} {'min':>6} {'max':>6} "
          f"{'identical':>10}")
    for r in results:
        ident = "-" if r["identical"] is None else str(r["identical"])
        print(f"{r['mode']:<11} {r['ref_tps']:10.1f} {r['unmask_tps']:13.1f} {r['ratio_median']:10.2f} "
              f"{r['ratio_min']:6.2f} {r['ratio_max']:6.2f} {ident:>10}")
    print(json.dumps({"bench": "diffusion_gemma", "model": a.model.name, "canvas": spec.block_size,
                      "requests": a.requests, "max_new_tokens": a.max_new_tokens, "steps": a.steps,
                      "draws": a.draws, "mixed_lengths": a.mixed_lengths, "stability_threshold": a.stability_threshold,
                      "confidence_threshold": a.confidence_threshold,
                      "threads": a.threads, "dtype": a.dtype, "device": a.device,
                      "results": [{k: v for k, v in r.items() if k != "rounds"} for r in results]}))


if __name__ == "__main__":
    main()
