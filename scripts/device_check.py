"""One prepared accelerator check: correctness of the engine on a device against the CPU, then speed.

    python scripts/device_check.py --device cuda --out $OUT          # on a lent GPU machine
    python scripts/device_check.py --device cpu --quick              # the same code path here (smoke run)
    python scripts/device_check.py --part block --out $OUT           # issue 31: block-causal fast path, 1.7B shape
    python scripts/device_check.py --part block --shapes llada2-mini --out $OUT   # its MoE shape alone

1. Correctness, float32 (TF32 off): for the built-in model and a tiny random checkpoint of each family that
   builds without transformers' model classes, the device's logits for one ragged forward against the CPU's
   (max abs difference), and greedy generations (threshold 0.9 and one token per forward) token for token.
2. Speed: `LLM.generate` throughput of the built-in model at several batch sizes (random-token prompts, EOS
   ignored, interleaved rounds, median [min-max]), float32 and bfloat16.
3. Training: tokens/s of `unmask train` steps on the device (bf16 autocast where the device has it), the
   figure that says how much better a built-in model a few device minutes could train.

Writes device_check.json and device_check.md under --out and prints the markdown. Nothing here needs a
network; the tiny checkpoints are built on the spot (tests/tiny_checkpoints.py). It imports only torch,
safetensors, tokenizers and numpy from outside (no server or grammar packages), so the lent machine's stock
Python runs it from a bare checkout: `PYTHONUNBUFFERED=1 python3 scripts/device_check.py --out $OUT`
(first run on an H200 on 2026-12-04 under a 100 s limit, which cut it after the float32 speed rows, before
the bf16 and training parts and the JSON: the console lines are docs/bench/h200_device_check_console.txt,
the figures docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main(argv):\n", "The json module can be used to"]
TINY_FAMILIES = ("sdar", "llada", "dream", "fast_dllm_v2")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def logits_gap(path: Path, device: str) -> float:
    """Max abs difference between the device's and the CPU's logits for a two-request ragged forward."""
    from unmask.models.attention import AttentionBatch, Segment
    from unmask.models.loader import load_model

    outs = {}
    for dev in ("cpu", device):
        model, spec = load_model(path, dtype="float32", device=dev)
        lens = (11, 6)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(4, min(spec.arch.vocab_size, 200), (sum(lens),), generator=g)
        pos = torch.cat([torch.arange(n) for n in lens])
        bidir = spec.family.attention == "bidirectional"
        segs = [Segment(start=0, length=n, block_ids=None if bidir else (torch.arange(n) // spec.block_size).to(dev))
                for n in lens]
        with torch.inference_mode():
            hidden = model(ids.to(dev), pos.to(dev), AttentionBatch(segs).prepare())
            outs[dev] = model.logits(hidden).float().cpu()
    return (outs["cpu"] - outs[device]).abs().max().item()


def generations_match(path: Path, device: str, max_tokens: int) -> dict:
    from unmask.engine.llm import LLM
    from unmask.engine.params import GenerationParams

    res = {}
    for name, knobs in (("threshold_0.9", dict(policy="threshold", threshold=0.9)),
                        ("one_token_per_forward", dict(policy="topk", tokens_per_step=1))):
        params = GenerationParams(max_tokens=max_tokens, **knobs)
        toks = {}
        for dev in ("cpu", device):
            llm = LLM(path, dtype="float32", device=dev)
            prompts = [llm.encode(p) for p in PROMPTS] if (Path(path) / "tokenizer.json").is_file() else \
                [[5 + i, 9, 17 + i] for i in range(3)]
            toks[dev] = [o.token_ids for o in llm.generate(prompts, params)]
        same = sum(a == b for a, b in zip(toks["cpu"], toks[device]))
        first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                      for a, b in zip(toks["cpu"], toks[device])]
        res[name] = {"identical": same, "of": len(PROMPTS), "first_difference_at": first_diff}
    return res


def speed(device: str, dtype: str, batches: list[int], max_tokens: int, rounds: int) -> list[dict]:
    from unmask.engine.llm import LLM
    from unmask.throughput import measure

    llm = LLM(None, dtype=dtype, device=device)
    out = []
    for r in measure(llm, batches, 64, max_tokens, rounds, dict(policy="threshold", threshold=0.9)):
        tps = [r.tokens / s for s in r.seconds]
        out.append({"batch": r.batch, "tokens_per_s": {"median": statistics.median(tps), "min": min(tps),
                                                       "max": max(tps)},
                    "tokens_per_forward": statistics.median(r.tokens_per_forward)})
    return out


def training_speed(device: str, steps: int, rows: int, seq_len: int) -> dict:
    """Tokens/s of block-diffusion training steps (the trainer's objective, AdamW) on the built-in model."""
    from unmask.defaults import default_model_path
    from unmask.models.loader import load_model
    from unmask.train.objectives import Objective, diffusion_loss_sum, draw_noise
    from unmask.train.precision import use_bf16
    from unmask.train.trainer import DEFAULT_BLOCK_SIZES

    model, spec = load_model(default_model_path(), dtype="float32", device=device)
    model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    obj = Objective(mask_id=spec.mask_id, block_sizes=DEFAULT_BLOCK_SIZES, shift=spec.shift)
    bf16 = use_bf16(None, device)
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16)
    x0 = torch.randint(16, spec.arch.vocab_size, (rows, seq_len), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.ones_like(x0, dtype=torch.bool)
    x0 = x0.to(device)
    times = []
    for i in range(steps + len(DEFAULT_BLOCK_SIZES)):  # the first steps pay allocation and kernel selection
        noise = draw_noise(obj, loss_mask, torch.Generator().manual_seed(i))
        sync(device)
        t0 = time.perf_counter()
        with autocast:
            loss = diffusion_loss_sum(model, x0, noise, obj) / loss_mask.sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        if i >= len(DEFAULT_BLOCK_SIZES):
            times.append(time.perf_counter() - t0)
    return {"rows": rows, "seq_len": seq_len, "bf16": bf16, "steps": steps,
            "tokens_per_s": rows * seq_len / statistics.median(times)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "device-check")
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run of every part")
    ap.add_argument("--part", choices=("engine", "block", "all"), default="engine",
                    help="engine: the parts above; block: issue 31's block-causal fast path at the Qwen3-1.7B shape "
                         "(scripts/device_check_block.py); all: both")
    ap.add_argument("--tiny", action="store_true", help="block part: tiny shapes (the CPU suite's smoke run)")
    ap.add_argument("--shapes", choices=("all", "qwen3-1.7b", "llada2-mini"), default="all",
                    help="block part: the dense 1.7B shape, LLaDA2.0-mini's MoE (scripts/device_check_moe.py; after "
                         "the dense one, in what the time budget leaves), or both")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="block part: batch sizes (default 1,4,16,64; --tiny 1,4)")
    ap.add_argument("--prompt-len", type=int, default=None, help="block part: prompt tokens (default 128; --tiny 16)")
    ap.add_argument("--max-tokens", type=int, default=None, help="block part: new tokens (default 64; --tiny 8)")
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="block part: sections that would end past this many seconds are skipped")
    ap.add_argument("--moe-reserve-s", type=float, default=110.0,
                    help="block part, both shapes: seconds of the budget the dense shape's sections leave to the MoE")
    args = ap.parse_args(argv)
    if args.part in ("block", "all"):
        import device_check_block

        args.batches = args.batches or ([1, 4] if args.tiny else [1, 4, 16, 64])
        args.prompt_len = args.prompt_len or (16 if args.tiny else 128)
        args.max_tokens = args.max_tokens or (8 if args.tiny else 64)
        device_check_block.run(args)
        if args.part == "block":
            return
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from tiny_checkpoints import FAMILIES
    from unmask.defaults import default_model_path

    report = {"device": args.device, "torch": torch.__version__, "python": platform.python_version(),
              "name": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor()}
    tmp = Path(tempfile.mkdtemp())
    checkpoints = {"unmask-tiny": default_model_path()}
    checkpoints.update({f: FAMILIES[f](tmp / f) for f in TINY_FAMILIES})
    report["correctness"] = {}
    for name, path in checkpoints.items():
        gap = logits_gap(path, args.device)
        gen = generations_match(path, args.device, 16 if args.quick else 64)
        report["correctness"][name] = {"max_abs_logit_gap": gap, "generations": gen}
        log(f"{name}: logits gap {gap:.2e}; {gen}")
    batches = [1, 4] if args.quick else [1, 16, 64, 256]
    report["speed"] = {}
    for dtype in ("float32", "bfloat16"):
        report["speed"][dtype] = speed(args.device, dtype, batches, 16 if args.quick else 128, 2 if args.quick else 3)
        log(f"speed {dtype}: {report['speed'][dtype]}")
    report["training"] = training_speed(args.device, 2 if args.quick else 20, 4 if args.quick else 64,
                                        128 if args.quick else 512)
    log(f"training: {report['training']}")

    md = [f"# Device check: {report['name']} ({args.device}), torch {report['torch']}\n",
          "| checkpoint | max abs logit gap vs CPU (float32) | threshold 0.9 identical | one token/forward identical |",
          "|---|---:|---:|---:|"]
    for name, c in report["correctness"].items():
        g = c["generations"]
        md.append(f"| {name} | {c['max_abs_logit_gap']:.2e} | {g['threshold_0.9']['identical']}/{g['threshold_0.9']['of']} "
                  f"| {g['one_token_per_forward']['identical']}/{g['one_token_per_forward']['of']} |")
    md += ["", "| dtype | batch | tokens/s median [min-max] | tokens/forward |", "|---|---:|---:|---:|"]
    for dtype, rows in report["speed"].items():
        for r in rows:
            t = r["tokens_per_s"]
            md.append(f"| {dtype} | {r['batch']} | {t['median']:.0f} [{t['min']:.0f}-{t['max']:.0f}] "
                      f"| {r['tokens_per_forward']:.2f} |")
    t = report["training"]
    md += ["", f"Training: {t['tokens_per_s']:,.0f} tokens/s ({t['rows']} x {t['seq_len']} rows, bf16 autocast "
           f"{t['bf16']}, median of {t['steps']} steps)."]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "device_check.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "device_check.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
