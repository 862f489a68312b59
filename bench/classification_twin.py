"""The AR twin (bench/models/ar-twin, Qwen3ForCausalLM) on the classification walkthrough (issue 33 item 4).

    python bench/classification_twin.py finetune --data data/fortunes/sft-train.jsonl --out runs/cls-fortunes-twin100 \
        --steps 100 --batch-size 8 --seq-len 384 --warmup 10 --lr 5e-4
    (then bench/classification.py --twin runs/cls-fortunes-twin100/model classifies with it)

`unmask finetune` trains diffusion models only and unmask does not serve a Qwen3ForCausalLM, so the twin is
fine-tuned here with the loop that trained it (scripts/train_ar_twin.py's `run_phase`: AdamW, warmup + cosine,
the same SFT rows as `unmask finetune --pack` builds, loss on the answer tokens) and the same settings as the
diffusion model's `unmask finetune` run, and it classifies with transformers: one forward per prompt (batched,
left-padded), the label whose first token scores highest (the labels' first tokens differ, so this is the
constrained choice decided in one forward, as `choice` is for unmask).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]


def _twin_script():
    spec = importlib.util.spec_from_file_location("train_ar_twin", ROOT / "scripts" / "train_ar_twin.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_ar_twin"] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def finetune(twin: Path, data: Path, out: Path, steps: int, batch_size: int, seq_len: int, warmup: int,
             lr: float, seed: int = 0, resume: bool = False, save_every: int = 50) -> Path:
    from transformers import AutoModelForCausalLM

    from unmask.models.loader import load_spec
    from unmask.tokenizer import Tokenizer
    from unmask.train.sft import SFTEncoder, load_sft

    tw = _twin_script()
    ref = load_spec(ROOT / "bench/models/unmask-tiny-5m")  # the twin's diffusion reference: its stop tokens
    enc = SFTEncoder(Tokenizer(twin), ref.eos_id, ref.stop_ids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # records longer than seq_len are skipped, as `unmask finetune` skips them
        rows, _ = load_sft(data, enc, seq_len, "skip", pack=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32)
    phase = tw.Phase("sft", steps, warmup, lr, batch_size, seq_len, steps=steps, warmup=warmup)
    args = SimpleNamespace(seed=seed, resume=resume, fp32=False, log_every=10, eval_every=0, eval_batches=0,
                           save_every=save_every)
    res = tw.run_phase(model, phase, rows, None, out / "sft", args)
    meta = {"kind": "autoregressive twin, fine-tuned for classification", "of": str(twin), "data": str(data),
            "command": " ".join([Path(sys.executable).name, *(a for a in sys.argv if a != "--resume")]),
            "phases": {"sft": res}}
    gen = json.loads((twin / "generation_config.json").read_text())
    return tw.export(model, out / "model", twin, gen, meta)


class TwinClassifier:
    """Label = argmax over the labels' first tokens of the next-token logits after the chat prompt."""

    def __init__(self, model_dir: Path, labels, threads: int | None = None):
        from transformers import AutoModelForCausalLM

        from unmask.tokenizer import Tokenizer

        if threads:
            torch.set_num_threads(threads)
        self.tok = Tokenizer(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.labels = list(labels)
        first = [self.tok.encode(lab)[0] for lab in self.labels]
        if len(set(first)) != len(first):
            raise ValueError(f"labels {self.labels} share a first token: one forward cannot decide them")
        self.first = torch.tensor(first)
        self.pad = int(self.model.config.pad_token_id or 0)

    def classify(self, prompts: list[str], batch_size: int = 16) -> list[str]:
        out = []
        for i in range(0, len(prompts), batch_size):
            ids = [self.tok.encode(self.tok.apply_chat_template([{"role": "user", "content": p}]))
                   for p in prompts[i:i + batch_size]]
            n = max(map(len, ids))
            x = torch.tensor([[self.pad] * (n - len(s)) + s for s in ids])
            mask = torch.tensor([[0] * (n - len(s)) + [1] * len(s) for s in ids])
            pos = (mask.cumsum(1) - 1).clamp(min=0)
            with torch.inference_mode():
                logits = self.model(input_ids=x, attention_mask=mask, position_ids=pos).logits[:, -1]
            out += [self.labels[j] for j in logits[:, self.first].argmax(1).tolist()]
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    ft = sub.add_parser("finetune")
    ft.add_argument("--twin", type=Path, default=ROOT / "bench/models/ar-twin")
    ft.add_argument("--data", type=Path, required=True)
    ft.add_argument("--out", type=Path, required=True)
    ft.add_argument("--steps", type=int, default=100)
    ft.add_argument("--batch-size", type=int, default=8)
    ft.add_argument("--seq-len", type=int, default=384)
    ft.add_argument("--warmup", type=int, default=10)
    ft.add_argument("--lr", type=float, default=5e-4)
    ft.add_argument("--seed", type=int, default=0)
    ft.add_argument("--threads", type=int, default=None)
    ft.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    for p in (args.twin, args.data):
        if not p.exists():
            sys.exit(f"error: {p} does not exist")
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    path = finetune(args.twin, args.data, args.out, args.steps, args.batch_size, args.seq_len, args.warmup,
                    args.lr, args.seed, args.resume)
    print(f"done in {time.perf_counter() - t0:.0f} s: {path}")


if __name__ == "__main__":
    main()
