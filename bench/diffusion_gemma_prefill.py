"""DiffusionGemma long-prompt paths, interleaved A/B of unmask alone (models/diffusion_gemma.py).

    python bench/diffusion_gemma_prefill.py --model /tmp/dgemma --prompt-len 1500,2000 --requests 4 --off long
    python bench/diffusion_gemma_prefill.py --model /tmp/dgemma --prompt-len 8000,8192 --requests 2 --off split

--off long   turns off every long-encoder path (LONG_ENCODER raised): dense [n, n] masks on every layer;
--off split  keeps them but turns off the full layers' prefix / own-keys split of later prefill chunks
             (prompts longer than the step budget, 4096 tokens).
Requests run one after another (each to completion), reference draws; first checks the two variants give
the same tokens, then prints median wall seconds and the per-round ratio off / on, median [min-max].
`--make-tiny` of bench/diffusion_gemma.py builds the checkpoint.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from diffusion_gemma import prompts_for  # noqa: E402
from unmask.engine.engine import Engine  # noqa: E402
from unmask.engine.params import GenerationParams  # noqa: E402
from unmask.models import diffusion_gemma as dg  # noqa: E402
from unmask.models.loader import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--prompt-len", default="1500,2000")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--off", choices=("long", "split"), default="long")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, spec = load_model(args.model, dtype="float32")  # the float32 of the committed figures
    lo, hi = (int(x) for x in args.prompt_len.split(","))
    prompts = prompts_for(args.requests, spec.arch.vocab_size, lo, hi, 0)
    on_threshold, on_split = dg.LONG_ENCODER, dg.can_split_on

    def setting(on: bool) -> None:
        dg.LONG_ENCODER = on_threshold if on or args.off != "long" else 1 << 40
        dg.can_split_on = on_split if on or args.off != "split" else (lambda x: False)

    def run() -> tuple[float, list[list[int]]]:
        eng = Engine(model, spec, max_num_seqs=args.requests)
        outs = []
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            seq = eng.add_request(p, GenerationParams(max_tokens=args.max_new_tokens, steps=16, seed=i,
                                                      stop_token_ids=[]))
            eng.run_to_completion()
            outs.append(seq.output_ids)
        return time.perf_counter() - t0, outs

    setting(True)
    run()  # warm-up
    _, with_on = run()
    setting(False)
    _, with_off = run()
    print(f"same tokens with the paths on and off: {with_on == with_off}")
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.rounds):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            setting(on)
            times[on].append(run()[0])
    setting(True)
    ratios = [off / on for on, off in zip(times[True], times[False])]
    print(f"--off {args.off}, prompts {lo}-{hi} tokens x {args.requests}: on {statistics.median(times[True]):.3f} s, "
          f"off {statistics.median(times[False]):.3f} s, off/on median {statistics.median(ratios):.2f} "
          f"[{min(ratios):.2f}-{max(ratios):.2f}] over {args.rounds} rounds")


if __name__ == "__main__":
    main()
