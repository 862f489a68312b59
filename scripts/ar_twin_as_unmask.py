"""Write the AR twin (Qwen3ForCausalLM) as an unmask-family checkpoint, the start of an AR-initialised distillation.

The twin (`scripts/train_ar_twin.py`) has the unmask reference's shape and parameter names (it starts from the
reference's causal base, loaded unchanged), so the twin's weights under the reference's `config.json` (causal
context, shifted logits) are an unmask model whose clean rows compute exactly the twin's causal forward: its
next-token decoding writes the twin's greedy text (tests/test_ar_twin_as_unmask.py compares it with transformers'
`generate`).
Its mask rows are untrained; `unmask distill` on its own answers then teaches them to draft, which is the
AR-to-block-diffusion adaptation of SDAR and Fast-dLLM v2 at this size (docs/training.md, "From the AR twin").

    .venv/bin/python scripts/ar_twin_as_unmask.py --twin bench/models/ar-twin --reference bench/models/unmask-tiny-5m \
        --out runs/twin-unmask
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

# the reference's files that describe the model and its tokenizer; the weights come from the twin
COPIED = ("config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json")


def convert(twin: Path, reference: Path, out: Path) -> Path:
    """out/: the reference's config and tokenizer files with the twin's weights. Refuses a twin whose tokenizer,
    parameter names or shapes differ from the reference's (one line naming the first difference)."""
    from safetensors import safe_open

    if (twin / "tokenizer.json").read_bytes() != (reference / "tokenizer.json").read_bytes():
        raise ValueError(f"{twin} numbers tokens differently from {reference} (tokenizer.json differs)")
    shapes = []
    for d in (twin, reference):
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            shapes.append({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    if shapes[0] != shapes[1]:
        diff = sorted(set(shapes[0].items()) ^ set(shapes[1].items()))[0]
        raise ValueError(f"{twin} and {reference} differ in parameter {diff[0]} {diff[1]}: not the same shape")
    cfg = json.loads((reference / "config.json").read_text())
    if not (cfg.get("causal_context") and cfg.get("shift_logits")):
        raise ValueError(f"{reference} is not a causal-context model with shifted logits: the twin's causal "
                         "forward is its clean rows only under both")
    out.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        if (reference / name).is_file():
            shutil.copyfile(reference / name, out / name)
    shutil.copyfile(twin / "model.safetensors", out / "model.safetensors")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--twin", type=Path, default=Path("bench/models/ar-twin"))
    ap.add_argument("--reference", type=Path, default=Path("bench/models/unmask-tiny-5m"))
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    try:
        print(convert(a.twin, a.reference, a.out))
    except (OSError, ValueError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
