"""Train the autoregressive twin of the default diffusion model, at the same compute, in Qwen3 format.

    python scripts/train_ar_twin.py --init-from bench/models/unmask-tiny-base --out runs/ar-twin   # the twin
    python scripts/train_ar_twin.py --quick --out build/ar-twin-quick   # a tiny run that proves the pipeline

The twin is an ordinary causal LM (transformers `Qwen3ForCausalLM`: the same layout as unmask's own
family, q/k norms included, so the parameter count is identical) with the reference model's
tokenizer, width, depth, heads, MLP size and tied embeddings.

The 5.25M `unmask-tiny` (built in until 2026-12-04, now bench/models/unmask-tiny-5m) is AR-initialised
(`make model-5m`): a causal next-token base (`unmask train --objective causal`), then block diffusion from
it, then SFT. The twin branches from that same base
(`--init-from`, its weights loaded unchanged: the base is a causal LM in Qwen3 names) and spends the
compute of the diffusion phases on causal training instead: the same packed rows of `data/corpus`
in the same order (same seed, same `BatchIterator`) as each block-diffusion run, then the same packed
SFT rows of `data/sft/train.jsonl` with the loss on the same answer tokens, mixed with the same share of
plain-text rows. Both models therefore have the base's compute plus equal compute after it.
A recipe with several block-diffusion runs (`make model-5m`: 592 steps at lr 1e-3, then 600 more at 5e-4)
is mirrored stage by stage: `--ref-pretrain-steps 592,600 --ref-pretrain-lr 1e-3,5e-4`, each stage with
its own warmup and cosine schedule and its data order restarted, as each `unmask train` run has.
`--init-from` also takes an earlier twin's OUT/pretrain/model, to add a stage without redoing the first.
Without `--init-from` the twin starts from the trainer's random initialisation (`--quick`, or a recipe
without a causal base: then pass every pre-training run's steps to --ref-pretrain-steps).
Optimizer, schedule shape, bf16 autocast (where native), weight decay, clipping and initialisation are the trainer's.

Compute matching (`--budget flops`, the default). Training FLOPs per row = 3 x forward (backward = 2x
forward), forward = 2 x multiply-adds:
  diffusion  6 * N_body * 2L  +  6 * D * V * E[masked]  +  3 * layers * 4 * (2L)^2 * H*dh
             (the [x_t ; x_0] input doubles the rows; only masked rows reach the LM head, E[masked] =
             E[p] * eligible = 0.5 * eligible; the [2L, 2L] block-diffusion mask runs dense in SDPA)
  AR         6 * N_body * L   +  6 * D * V * eligible   +  3 * layers * 4 * L^2 * H*dh / 2
             (causal attention: the kernel skips the upper triangle; only loss rows reach the head)
N_body = the transformer blocks' matrix parameters (embeddings are lookups). Each phase of the twin gets
round(reference phase FLOPs / twin FLOPs per step) steps at the reference batch and row length, and
its warmup is scaled by the same factor. `--budget tokens` instead gives the twin exactly the
reference's steps (the same data tokens, about half the compute). The accounting is written to
OUT/budget.json and printed.

Outputs: OUT/pretrain/model (after pre-training; OUT/pretrain2/model, ... after each further stage),
OUT/model (final, after SFT): Hugging Face
directories that `AutoModelForCausalLM.from_pretrained` loads offline, with the tokenizer files.
Checkpoints go to OUT/<phase>/checkpoint.pt every --save-every steps; --resume continues a killed run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# the twin's shape, FLOP accounting and model (build, load, score, export); Shape is re-exported for the tests
from ar_twin_model import (Phase, Shape, ar_flops_per_row, build_twin, diffusion_flops_per_row,  # noqa: E402,F401
                           export, load_base, loss_sum, shape_from)

from unmask.models.loader import load_spec  # noqa: E402
from unmask.tokenizer import Tokenizer  # noqa: E402
from unmask.train.data import (BatchIterator, TokenRows, eval_batches, load_pretraining, mix_rows,  # noqa: E402
                               pack_documents)
from unmask.train.precision import bf16_is_fast  # noqa: E402
from unmask.train.sft import SFTEncoder, load_sft  # noqa: E402


# ---------------------------------------------------------------------------------------------- loop

def pretrain_stages(steps: str, warmup: str, lr: str) -> list[tuple[str, int, int, float]]:
    """(name, steps, warmup, lr) of each pre-training stage from the comma-separated options; a single warmup or
    lr applies to every stage. Stages are named pretrain, pretrain2, ... (their checkpoint folders)."""
    def split(value: str, cast, what: str) -> list:
        try:
            items = [cast(x) for x in str(value).split(",")]
        except ValueError:
            sys.exit(f"--ref-pretrain-{what}: expected comma-separated numbers, got {value!r}")
        return items

    n = split(steps, int, "steps")
    w, r = split(warmup, int, "warmup"), split(lr, float, "lr")
    for what, items in (("warmup", w), ("lr", r)):
        if len(items) not in (1, len(n)):
            sys.exit(f"--ref-pretrain-{what}: {len(items)} values for {len(n)} stages (give one, or one per stage)")
    w, r = w * len(n) if len(w) == 1 else w, r * len(n) if len(r) == 1 else r
    return [("pretrain" if i == 0 else f"pretrain{i + 1}", n[i], w[i], r[i]) for i in range(len(n))]


def run_phase(model, phase: Phase, rows: TokenRows, eval_rows: TokenRows | None, out: Path, args) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=phase.lr, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:  # unmask.train.trainer.lr_lambda, min_lr_ratio 0.1
        if step < phase.warmup:
            return (step + 1) / phase.warmup
        done = min(1.0, (step - phase.warmup) / max(1, phase.steps - phase.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    batches = BatchIterator(len(rows), phase.batch, args.seed)
    step, losses, evals, train_s = 0, [], [], 0.0
    ckpt = out / "checkpoint.pt"
    if args.resume and ckpt.is_file():
        st = torch.load(ckpt, map_location="cpu", weights_only=False)
        if st["phase"] != asdict(phase):
            sys.exit(f"{ckpt}: was taken with {st['phase']}, this run plans {asdict(phase)}")
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        batches.load_state_dict(st["data"])
        step, losses, evals, train_s = st["step"], st["losses"], st["evals"], st["train_s"]
        print(f"{phase.name}: resumed at step {step}", flush=True)
    device = next(model.parameters()).device
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=not args.fp32 and bf16_is_fast(device))
    first, first_s = step, train_s

    def evaluate() -> float:
        model.eval()
        tot, n = 0.0, 0
        with torch.no_grad(), autocast:
            for idx in eval_batches(len(eval_rows), phase.batch, args.eval_batches):
                ids, lm = (t.to(device) for t in eval_rows.batch(idx))
                s, c = loss_sum(model, ids, lm)
                tot, n = tot + float(s), n + c
        model.train()
        return tot / max(n, 1)

    def save() -> None:
        tmp = ckpt.with_suffix(".tmp")
        torch.save({"phase": asdict(phase), "model": model.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(), "data": batches.state_dict(), "step": step,
                    "losses": losses, "evals": evals, "train_s": train_s}, tmp)
        os.replace(tmp, ckpt)

    model.train()
    print(f"{phase.name}: {phase.steps} steps x {phase.batch} rows x {phase.seq_len}, warmup {phase.warmup}, "
          f"lr {phase.lr:g}, {len(rows):,} rows", flush=True)
    while step < phase.steps:
        t0 = time.perf_counter()
        ids, lm = rows.batch(next(batches))
        n_elig = max(1, int(lm[:, 1:].sum()))
        ids, lm = ids.to(device, non_blocking=True), lm.to(device, non_blocking=True)
        with autocast:
            s, _ = loss_sum(model, ids, lm)
        loss = s / n_elig
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        losses.append(float(loss.detach()))
        train_s += time.perf_counter() - t0
        tps = phase.batch * phase.seq_len * (step - first) / max(train_s - first_s, 1e-9)
        if step % args.log_every == 0 or step == phase.steps:
            eta = time.strftime("%H:%M:%S", time.gmtime((phase.steps - step) * phase.batch * phase.seq_len / tps))
            print(f"step {step}/{phase.steps} loss {losses[-1]:.4f} lr {sched.get_last_lr()[0]:.2e} "
                  f"{tps:,.0f} tok/s eta {eta}", flush=True)
        if eval_rows is not None and args.eval_every and (step % args.eval_every == 0 or step == phase.steps):
            evals.append((step, evaluate()))
            print(f"step {step}: eval loss {evals[-1][1]:.4f}", flush=True)
        if (args.save_every and step % args.save_every == 0) or step == phase.steps:
            save()
    return {"steps": step, "final_loss": losses[-1] if losses else None, "evals": evals, "train_s": train_s,
            "tokens_per_s": phase.batch * phase.seq_len * step / max(train_s, 1e-9)}


# ---------------------------------------------------------------------------------------------- main

def _relative(path: Path) -> str:
    """The path as recorded in budget.json: relative to the checkout where it lies inside it."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/ar-twin"))
    ap.add_argument("--reference", type=Path, default=None,
                    help="diffusion model whose shape the twin copies (default: the built-in model, else runs/pretrain/model)")
    ap.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="default: the --init-from base's own tokenizer files (a rebuilt data/tokenizer can number "
                         "tokens differently), else data/tokenizer")
    ap.add_argument("--sft", type=Path, default=Path("data/sft/train.jsonl"))
    ap.add_argument("--sft-eval", type=Path, default=Path("data/sft/heldout.jsonl"))
    ap.add_argument("--budget", choices=("flops", "tokens"), default="flops")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="the causal base the diffusion model was initialised from (unmask format, shift_logits), "
                         "or an earlier twin stage (Qwen3ForCausalLM); the twin starts from the same weights and "
                         "matches the compute spent after it")
    # the reference recipe (Makefile `model-5m`): what the diffusion model was trained with after the base
    ap.add_argument("--ref-pretrain-steps", default="592",
                    help="steps of each block-diffusion pre-training run after the base, comma-separated: each "
                         "run is a stage of the twin with its own warmup + cosine schedule, as in the recipe")
    ap.add_argument("--ref-pretrain-warmup", default="30", help="warmup of each stage (one value, or one per stage)")
    ap.add_argument("--ref-pretrain-lr", default="1e-3", help="peak lr of each stage (one value, or one per stage)")
    ap.add_argument("--ref-sft-steps", type=int, default=359)
    ap.add_argument("--ref-sft-warmup", type=int, default=20)
    ap.add_argument("--ref-sft-lr", type=float, default=5e-4)
    ap.add_argument("--ref-sft-mix", type=float, default=0.25,
                    help="share of plain-text rows in the SFT phase (finetune --mix-fraction)")
    ap.add_argument("--ref-next-token-loss", type=int, choices=(0, 1), default=None,
                    help="1: the reference's diffusion phases also scored the next-token loss of every clean row "
                         "(`train --causal-context`, next_token_weight > 0), whose LM-head rows the budget counts; "
                         "default: 1 when the reference's config.json has \"causal_context\": true")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--skip-sft", action="store_true", help="pre-training only (OUT/model = the pre-trained twin)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", help="auto (CUDA when there is one, else the CPU) | cpu | cuda[:N]")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--fp32", action="store_true",
                    help="no bf16 autocast (default: bf16 autocast where the device computes bf16 natively)")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile each decoder layer in place (measured 1.1-1.6x faster steps on 2 busy "
                         "cores after ~45 s of compiling; same FLOPs, so the budget is unchanged)")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="CI-sized: 40 documents, 4 rows x 128 tokens, reference recipe 6 + 4 steps")
    ap.add_argument("--dry-run", action="store_true", help="print the budget and exit")
    args = ap.parse_args()
    from unmask.errors import UnmaskError
    from unmask.models.loader import check_device, resolve_device

    args.device = resolve_device(args.device)  # auto: UNMASK_DEVICE, else CUDA when there is one, else the CPU
    try:
        check_device(args.device)
    except UnmaskError as e:
        sys.exit(f"error: {e}")
    if args.quick:
        args.batch_size, args.seq_len = 4, 128
        args.ref_pretrain_steps, args.ref_pretrain_warmup, args.ref_sft_steps, args.ref_sft_warmup = "6", "2", 4, 1
        args.eval_every, args.eval_batches, args.save_every, args.log_every = 0, 1, 0, 2
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    from unmask.defaults import default_model_path

    # the committed twin is compute-matched to the 5.25M model (the built-in one until 2026-12-04)
    ref = args.reference or next((p for p in (ROOT / "bench/models/unmask-tiny-5m", default_model_path(),
                                              ROOT / "runs/pretrain/model") if p.is_dir()), None)
    if ref is None:
        sys.exit("no reference model: pass --reference DIR (a diffusion model whose shape the twin copies)")
    shape, ref_config, ref_gen = shape_from(ref)
    if args.tokenizer is None:
        args.tokenizer = args.init_from if args.init_from is not None else Path("data/tokenizer")
    tok = Tokenizer(args.tokenizer)
    hf = tok.hf
    sep = tok.token_id("<|endoftext|>")
    sep = sep if sep is not None else hf.eos_token_id
    if len(hf) > shape.vocab:
        sys.exit(f"tokenizer {args.tokenizer} has {len(hf)} tokens, the reference vocabulary {shape.vocab}")

    # the same rows as the reference run
    if args.quick:
        from unmask.train.corpus import read_documents

        docs = [d for _, d in zip(range(40), read_documents(args.corpus / "train.jsonl"))]
        rows = pack_documents((tok.encode(d.text) for d in docs), args.seq_len, sep)
        held = [d for _, d in zip(range(4), read_documents(args.corpus / "heldout.jsonl"))]
        eval_rows = pack_documents((tok.encode(d.text) for d in held), args.seq_len, sep)
    else:
        rows, eval_rows = load_pretraining(args.corpus, tok, args.seq_len, sep, args.out / "tokens")
    ref_spec = load_spec(ref)
    enc = SFTEncoder(tok, ref_spec.eos_id, ref_spec.stop_ids)  # as `finetune` builds it from the reference
    sft_rows = sft_eval = None
    if not args.skip_sft:
        sft_path = args.sft
        if args.quick:  # the first 200 records
            args.out.mkdir(parents=True, exist_ok=True)
            sft_path = args.out / "sft-quick.jsonl"
            with open(args.sft) as fh:
                sft_path.write_text("".join(line for _, line in zip(range(200), fh)))
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "skipped N records longer than seq_len": the reference skips them too
            sft_rows, _ = load_sft(sft_path, enc, args.seq_len, "skip", pack=True)
            if args.ref_sft_mix > 0:  # the same mixed rows as `finetune --mix-text` builds (same seed)
                sft_rows = mix_rows(sft_rows, rows, args.ref_sft_mix, args.seed)
            if args.sft_eval.is_file() and not args.quick:
                sft_eval, _ = load_sft(args.sft_eval, enc, args.seq_len, "skip", pack=True)

    next_token = bool(ref_config.get("causal_context")) if args.ref_next_token_loss is None \
        else bool(args.ref_next_token_loss)
    phases = [Phase(name, steps, warmup, lr, args.batch_size, args.seq_len, eligible=float(args.seq_len),
                    next_token=next_token)
              for name, steps, warmup, lr in pretrain_stages(args.ref_pretrain_steps, args.ref_pretrain_warmup,
                                                             args.ref_pretrain_lr)]
    n_pre = len(phases)
    if sft_rows is not None:
        elig = float(sft_rows.loss_mask.float().sum(1).mean())
        phases.append(Phase("sft", args.ref_sft_steps, args.ref_sft_warmup, args.ref_sft_lr, args.batch_size,
                            args.seq_len, eligible=elig, next_token=next_token))
    for ph in phases:
        ph.plan(shape, args.budget)
    budget = {
        "budget": args.budget, "reference": _relative(ref), "shape": asdict(shape), "body_params": shape.body_params,
        "diffusion_flops_per_row": {ph.name: diffusion_flops_per_row(shape, ph.seq_len, ph.eligible, ph.next_token)
                                    for ph in phases},
        "ar_flops_per_row": {ph.name: ar_flops_per_row(shape, ph.seq_len, ph.eligible) for ph in phases},
        "phases": [asdict(ph) for ph in phases],
        "reference_total_flops": sum(ph.ref_flops for ph in phases),
        "twin_total_flops": sum(ph.steps * ph.twin_flops_per_step for ph in phases),
        "reference_data_tokens": sum(ph.ref_steps * ph.batch * ph.seq_len for ph in phases),
        "twin_data_tokens": sum(ph.steps * ph.batch * ph.seq_len for ph in phases),
        "quick": args.quick,
        "init_from": str(args.init_from) if args.init_from else None,
    }
    print(f"reference {ref}: {shape.body_params / 1e6:.2f}M body parameters, vocab {shape.vocab}")
    for ph in phases:
        ratio = budget["diffusion_flops_per_row"][ph.name] / budget["ar_flops_per_row"][ph.name]
        print(f"  {ph.name}: diffusion {ph.ref_steps} steps = {ph.ref_flops:.3g} FLOPs; a twin row costs 1/{ratio:.2f} "
              f"of a diffusion row -> twin {ph.steps} steps (warmup {ph.warmup}), {ph.eligible:.0f} loss tokens/row")
    print(f"  total: reference {budget['reference_total_flops']:.3g} FLOPs, twin {budget['twin_total_flops']:.3g} "
          f"FLOPs; data tokens {budget['reference_data_tokens']:,} vs {budget['twin_data_tokens']:,}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "budget.json").write_text(json.dumps(budget, indent=2) + "\n")
    if args.dry_run:
        return

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(args.seed)
    model = build_twin(shape, ref_config, args.seed)
    if args.init_from is not None:
        load_base(model, args.init_from)
        print(f"twin starts from the causal base {args.init_from}", flush=True)
    device = torch.device(args.device)  # resolved and checked after parsing
    model.to(device)  # (untested on a GPU so far: CI and this machine are CPU-only)
    print(f"training on {device}", flush=True)
    if args.compile:  # nn.Module.compile keeps parameter names, so checkpoints and the export are unchanged
        for layer in model.model.layers:
            layer.compile()
    # Inside the repository the reference is recorded relative to it, so the committed file names no machine's path.
    ref_path = Path(ref).resolve()
    of = ref_path.relative_to(ROOT).as_posix() if ref_path.is_relative_to(ROOT) else str(ref)
    meta = {"kind": "autoregressive twin", "of": of, "budget": args.budget, "quick": args.quick,
            "init_from": str(args.init_from) if args.init_from else None,
            # the command that reproduces the run: --resume only says how this process started
            "command": " ".join([Path(sys.executable).name, *(a for a in sys.argv if a != "--resume")]),
            "phases": {}}
    for ph in phases[:n_pre]:  # each stage restarts the data order, as a new `unmask train` run does
        meta["phases"][ph.name] = run_phase(model, ph, rows, eval_rows, args.out / ph.name, args)
        final = export(model, args.out / ph.name / "model", args.tokenizer, ref_gen, meta)
    if sft_rows is not None:
        res = run_phase(model, phases[n_pre], sft_rows, sft_eval, args.out / "sft", args)
        meta["phases"]["sft"] = res
    meta["wall_s"] = time.perf_counter() - t_start
    final = export(model, args.out / "model", args.tokenizer, ref_gen, meta)
    print(f"done in {meta['wall_s']:.0f} s: {final} (Qwen3ForCausalLM)", flush=True)


if __name__ == "__main__":
    main()
