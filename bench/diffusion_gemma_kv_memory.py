"""DiffusionGemma KV-cache memory: every position kept on every layer vs sliding layers keeping their window,
with the cache's capacity doubling freely or capped at the request's prompt + max_tokens.

    python bench/diffusion_gemma_kv_memory.py [--context 131072] [--window 1024] [--chunk 4096]

Replays the cache reservations of one request (a prompt prefilled in `--chunk`-token encoder chunks, then
canvases of `--canvas` tokens) on torch's meta device, so nothing is allocated: it reports the bytes the
buffers would hold at the peak. Layer shapes default to DiffusionGemmaTextConfig's class defaults (30 layers,
5 sliding : 1 full, sliding K/V 4 heads x 256, full K/V 2 heads x 512 as the release's config comment says),
bfloat16; the released checkpoint's per-layer sizes are not verified here (docs/diffusion-gemma.md).
"""
from __future__ import annotations

import argparse

import torch

from unmask.models.attention import KVCache, Segment
from unmask.models.diffusion_gemma import GemmaKVCache


def replay(cache: KVCache, prompt: int, chunk: int, canvas: int, canvases: int) -> int:
    """Peak bytes over the request's steps; cache.length advances as the engine commits encoder tokens."""
    peak, done = 0, 0
    while done < prompt:  # encoder-only chunks, the last one with the first canvas
        n = min(chunk, prompt - done)
        last = done + n == prompt
        Segment(start=done, length=n + (canvas if last else 0), write=n, cache=cache).prepare()
        done = cache.length = done + n
        peak = max(peak, cache.nbytes())
    for _ in range(canvases):  # each accepted canvas is encoded in the step that starts the next one
        Segment(start=cache.length, length=2 * canvas, write=canvas, cache=cache).prepare()
        cache.length += canvas
        peak = max(peak, cache.nbytes())
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=131072, help="prompt + generated tokens")
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=4096, help="encoder tokens per prefill step (engine token budget)")
    ap.add_argument("--canvas", type=int, default=256)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--sliding-kv", default="4x256", help="K/V heads x head dim of a sliding layer")
    ap.add_argument("--full-kv", default="2x512", help="K/V heads x head dim of a full-attention layer")
    a = ap.parse_args()
    sliding = [(i + 1) % 6 != 0 for i in range(a.layers)]
    sliding[-1] = False
    sk, fk = (tuple(int(x) for x in s.split("x")) for s in (a.sliding_kv, a.full_kv))
    shapes = [sk if s else fk for s in sliding]
    prompt = a.context - a.new_tokens
    canvases = a.new_tokens // a.canvas
    capacity = min(a.context, 4096)  # what the engine asks for at admission (engine.py add_request)
    rows = {}
    for name, limit in (("doubling", None), ("capped", a.context)):
        rows[name] = (replay(KVCache(shapes, torch.bfloat16, "meta", capacity, limit), prompt, a.chunk, a.canvas,
                             canvases),
                      replay(GemmaKVCache(shapes, sliding, a.window, torch.bfloat16, "meta", capacity, limit), prompt,
                             a.chunk, a.canvas, canvases))
    print(f"{a.layers} layers ({sum(sliding)} sliding, window {a.window}), context {a.context:,} "
          f"({prompt:,} prompt in {a.chunk}-token chunks + {canvases} canvases of {a.canvas}), bf16")
    base = rows["doubling"][0]
    for name, label in (("doubling", "capacity doubles past the request's size"),
                        ("capped", "doubling capped at prompt + max_tokens")):
        for kind, nbytes in zip(("every position on every layer", "sliding layers keep their window"), rows[name]):
            print(f"{label:<42} {kind:<34} {nbytes / 2**30:6.2f} GiB peak ({base / nbytes:.1f}x less)")


if __name__ == "__main__":
    main()
