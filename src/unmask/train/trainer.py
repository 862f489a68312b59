"""Training loop shared by pre-training (`train`) and supervised fine-tuning (`finetune`).

One code path for 1..N processes: every rank draws the same global batch and the same noise
(all randomness is a function of seed and step), takes its own rows, and the loss is normalised
by the loss-eligible tokens of the *global* batch, so `torchrun --nproc_per_node 2` with B/2 rows
each computes what one process computes with B rows. DDP averages gradients across ranks, so
each rank's loss is scaled by the world size.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import time
import warnings
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from unmask import allocator
from unmask.models.transformer import DiffusionTransformer
from unmask.tokenizer import Tokenizer
from unmask.train.checkpoint import (CHECKPOINT, CheckpointError, clear_leftovers, load_checkpoint, rng_state,
                                     save_checkpoint, set_rng_state)
# the settings and result types live in config.py; callers import them from here as well
from unmask.train.config import DEFAULT_BLOCK_SIZES, TrainConfig, TrainDivergedError, TrainResult
from unmask.train.data import (BatchIterator, DataError, TokenRows, check_same_tokenizer, check_vocab, eval_batches,
                               load_pretraining, mix_rows)
from unmask.train.heap import trim
from unmask.train.model_init import (TrainableModel, TrainConfigError, apply_draft_adapter, apply_lora, count_params,
                                     fresh_model, frozen_fingerprint, load_trainable, shape_config, trainable_state)
from unmask.train.objectives import Noise, Objective, diffusion_loss_sum, draw_noise, loss_eligible
from unmask.train.precision import use_bf16
from unmask.train.processes import _Dist, _Reporter
from unmask.train.resume import check_resume
from unmask.train.run_dir import earlier_run, export_run, finish_run, prepare_run
from unmask.train.sft import SFTEncoder, load_sft


# ------------------------------------------------------------------ the loop

class _LossModule(nn.Module):
    """The model plus the objective, so DDP wraps one forward that returns the loss."""

    def __init__(self, model: DiffusionTransformer, obj: Objective, anchor: DiffusionTransformer | None = None):
        super().__init__()
        self.model, self.obj = model, obj
        self._anchor = [anchor]   # in a list: not a submodule, so DDP and state dicts see the trained model alone

    def forward(self, x0: Tensor, masked: Tensor, p: Tensor, block_size: int, eligible: Tensor,
                corrupt: Tensor | None = None, tokens: Tensor | None = None, keep: Tensor | None = None) -> Tensor:
        noise = Noise(block_size or None, masked, p, corrupt, tokens, keep)
        return diffusion_loss_sum(self.model, x0, noise, self.obj, eligible, self._anchor[0])


def frozen_copy(model: nn.Module) -> nn.Module:
    """The model as it is now, in eval mode and without gradients: the anchor of `anchor_weight`."""
    anchor = copy.deepcopy(model).eval()
    for param in anchor.parameters():
        param.requires_grad_(False)
    return anchor


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """Linear warmup, then cosine decay to min_lr_ratio at total_steps."""
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        done = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * done))
    return f


def _optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]  # norms, biases
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas)


def _noise_gen(seed: int, step: int, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 31 + salt)


def _millions(n: int) -> str:
    """2 decimals of a million, or the plain count below 10,000 (a tiny LoRA read '0.00M trained')."""
    return f"{n / 1e6:.2f}M" if n >= 10_000 else f"{n:,}"



def _train_step(cfg: TrainConfig, ctx: _Dist, loss_module: nn.Module, obj: Objective, x0: Tensor, lm: Tensor,
                noise: Noise, autocast) -> float:
    """Forward/backward over this rank's micro-batches; returns the global loss of the batch."""
    B, A, W = cfg.batch_size, cfg.grad_accum, ctx.world
    eligible = loss_eligible(lm, obj.shift)
    n_eligible = max(1, int(eligible.sum()))  # of the global batch, on every rank
    loss_sum = 0.0
    for m in range(A):
        lo = m * (B // A) + ctx.rank * (B // (A * W))
        mine = slice(lo, lo + B // (A * W))
        sync = contextlib.nullcontext() if (W == 1 or m == A - 1) else loss_module.no_sync()
        with sync:
            mn = noise.rows(mine)
            with autocast:
                part = loss_module(x0[mine].to(ctx.device), mn.masked, mn.p, noise.block_size or 0, eligible[mine],
                                   mn.corrupt, mn.tokens, mn.keep)
            (part * (W / n_eligible)).backward()  # DDP divides by W when it averages
        loss_sum += float(part.detach())
    return ctx.sum([loss_sum])[0] / n_eligible


def compile_blocks(model: nn.Module) -> int:
    """torch.compile every transformer block in place (nn.Module.compile: parameter names and checkpoints
    are unchanged). Inductor fuses the norms, rotary, casts and residual adds that dominate a CPU step
    after the matmuls and attention: 1.2-1.5x faster steps for unmask-tiny at 16 x 512 on 2 busy CPU cores,
    after ~45 s of compiling (bench/train_step.py; docs/training.md). On CPU it needs a C++ compiler."""
    blocks = _blocks(model, "compile")
    for block in blocks:
        block.compile()
    return len(blocks)


def checkpoint_blocks(model: nn.Module) -> int:
    """Activation checkpointing: each transformer block keeps only its input for the backward pass and runs its
    forward again there (torch.utils.checkpoint, non-reentrant), so a step holds one block's activations instead
    of every block's, for one more forward of each block (one 8K row of the built-in model: peak growth 1.6 GB
    instead of 4.4 GB, the step ~1.05x as long; one 32K row was OOM-killed at 24 GB without it; docs/training.md)."""
    blocks = _blocks(model, "checkpoint_activations")
    for block in blocks:
        block.forward = functools.partial(_recomputed, block.forward)  # an instance attribute: names unchanged
    return len(blocks)


def _recomputed(forward, *args):
    if not torch.is_grad_enabled():   # evaluation: nothing to keep
        return forward(*args)
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False)


def _blocks(model: nn.Module, what: str) -> nn.ModuleList:
    blocks = next((m for name, m in model.named_modules() if name.endswith("layers") and isinstance(m, nn.ModuleList)),
                  None)
    if blocks is None:
        raise TrainConfigError(f"{what}: no transformer block list (`layers`) in this model")
    return blocks


def run(cfg: TrainConfig, tm: TrainableModel, obj: Objective, rows: TokenRows, eval_rows: TokenRows | None,
        tokenizer_dir: Path | None, ctx: _Dist, on_step: Callable[[int, dict], None] | None = None) -> TrainResult:
    """The loop: batches, optimizer steps, eval, checkpoints, export. Resumes from out_dir if asked."""
    out = Path(cfg.out_dir)
    B, W = cfg.batch_size, ctx.world
    if rows.seq_len != cfg.seq_len:
        raise DataError(f"data rows have length {rows.seq_len}, seq_len is {cfg.seq_len}")
    max_pos = tm.config.get("max_position_embeddings")
    if ctx.main and isinstance(max_pos, int) and cfg.seq_len > max_pos:
        # allowed (RoPE extends), but the served model refuses prompts past its context, so say so
        warnings.warn(f"seq_len {cfg.seq_len} is longer than the model's context (max_position_embeddings "
                      f"{max_pos}): positions past it are trained, but serving still stops at {max_pos}", stacklevel=2)
    model = tm.model.to(ctx.device)
    model.train()
    # the starting weights, taken before a resumed run loads its checkpoint's
    anchor = frozen_copy(model) if obj.anchor_weight else None
    if cfg.checkpoint_activations:
        checkpoint_blocks(model)
    if cfg.compile:
        compile_blocks(model)
    opt = _optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    batches = BatchIterator(len(rows), B, cfg.seed)
    step, losses, evals, train_time = 0, [], [], 0.0

    if ctx.main:
        left = clear_leftovers(out)
        if left:
            print(f"{out}: removed {', '.join(left)}, left by a run killed while writing")
    # the base a LoRA or draft-adapter run's adapters belong to
    frozen = frozen_fingerprint(model) if tm.lora or cfg.draft_adapter_rank else None
    saved = load_checkpoint(out) if cfg.resume else None
    if ctx.main and cfg.resume and saved is None:
        print(f"{out}: no checkpoint to resume, starting fresh")
    elif ctx.main and cfg.overwrite and earlier_run(out):
        print(f"{out}: starting over (overwrite); the earlier run's files are replaced as this one saves")
    if saved is not None:
        check_resume(saved, cfg, tm, model, obj.block_sizes)
        if frozen is not None and saved.get("frozen") not in (None, frozen):
            raise CheckpointError("cannot resume: the base model's frozen weights differ from the checkpoint's "
                                  "(a LoRA run resumes on the base it started from; check --model)")
        try:
            model.load_state_dict(saved["model"], strict=False)
            opt.load_state_dict(saved["optimizer"])
            sched.load_state_dict(saved["scheduler"])
            batches.load_state_dict(saved["data"])
            set_rng_state(saved["rng"])
            step, losses, evals, train_time = saved["step"], saved["losses"], saved["evals"], saved["train_time"]
        except (KeyError, ValueError, RuntimeError, TypeError) as e:  # a damaged or foreign checkpoint
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"cannot resume from {out / CHECKPOINT}: {first}") from None
        # the saved optimizer and scheduler carry the old run's hyper-parameters: follow this run's lr, schedule,
        # weight decay and betas (resuming with a lower lr is what a divergence asks for); the same settings
        # give the same values, bit for bit. Groups as _optimizer builds them: matrices decay, the rest not.
        sched.base_lrs = [cfg.lr] * len(opt.param_groups)
        for group, decay in zip(opt.param_groups, (cfg.weight_decay, 0.0)):
            group["initial_lr"], group["lr"] = cfg.lr, cfg.lr * lr_lambda(cfg)(sched.last_epoch)
            group["weight_decay"], group["betas"] = decay, tuple(cfg.betas)
    first_step, first_time = step, train_time

    loss_module: nn.Module = _LossModule(model, obj, anchor)
    if W > 1:
        loss_module = nn.parallel.DistributedDataParallel(loss_module)
    bf16 = use_bf16(cfg.bf16, ctx.device)
    autocast = torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=bf16)
    rep = _Reporter(cfg, ctx.main, step)
    rep.log(f"{tm.family.name} model, {_millions(count_params(model))} parameters "
            f"({_millions(count_params(model, trainable=True))} trained), {len(rows):,} rows x {cfg.seq_len}, "
            f"{obj.describe()}, "
            f"{W} process(es) on {ctx.device}, {'bf16 autocast' if bf16 else 'float32'}"
            + (", jemalloc" if ctx.device.type == "cpu" and allocator.active() == "jemalloc" else "")
            + (f", resumed at step {step}" if saved else ""))

    def checkpoint() -> None:
        _check_finite_weights(model, step)  # never replace a good checkpoint with diverged weights
        if ctx.main:
            save_checkpoint(out, {
                "format": 1, "step": step, "model": trainable_state(model), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "data": batches.state_dict(), "rng": rng_state(),
                "config": asdict(cfg), "model_config": tm.config, "losses": losses, "evals": evals,
                "train_time": train_time, "frozen": frozen})
        ctx.barrier()

    # the diffusion loss alone, under independent masks: comparable across recipes
    eval_obj = replace(obj, next_token_weight=0.0, suffix_fraction=0.0, confidence_weight=0.0, full_block_fraction=0.0,
                       corrupt_fraction=0.0, anchor_weight=0.0, position_span=0)

    def evaluate() -> float:
        model.eval()
        total, n = 0.0, 0
        mine = slice(ctx.rank * B // W, (ctx.rank + 1) * B // W)
        with torch.no_grad(), autocast:
            for i, idx in enumerate(eval_batches(len(eval_rows), B, cfg.eval_batches)):
                x0, lm = eval_rows.batch(idx)
                noise = draw_noise(eval_obj, lm, _noise_gen(cfg.seed, i, salt=7))  # the same noise at every eval
                total += float(diffusion_loss_sum(model, x0[mine].to(ctx.device), noise.rows(mine), eval_obj))
                n += int(loss_eligible(lm, obj.shift).sum())
        model.train()
        return ctx.sum([total])[0] / max(n, 1)

    ctx.started = True
    try:
        while step < cfg.total_steps:
            t0 = time.perf_counter()
            x0, lm = rows.batch(next(batches))
            noise = draw_noise(obj, lm, _noise_gen(cfg.seed, step), x0)
            loss = _train_step(cfg, ctx, loss_module, obj, x0, lm, noise, autocast)
            trim()   # the step's freed tensors leave heap holes glibc keeps resident (heap.py)
            if not math.isfinite(loss):  # the same value on every rank: all stop together
                raise TrainDivergedError(_diverged(step + 1, f"the training loss is {loss}", sched))
            if cfg.grad_clip:
                norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                                      cfg.grad_clip)
                if not math.isfinite(float(norm)):  # AdamW would write it into every weight
                    raise TrainDivergedError(_diverged(step + 1, f"the gradient norm is {float(norm)}", sched))
            try:
                opt.step()
            except RuntimeError as e:  # AdamW's step size (lr / bias correction) beyond float32
                if "overflow" not in str(e):
                    raise
                raise TrainDivergedError(_diverged(step + 1, "the optimizer's step overflows float32", sched)) from None
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            losses.append(loss)
            train_time += time.perf_counter() - t0
            tps = B * cfg.seq_len * (step - first_step) / max(train_time - first_time, 1e-9)
            lr = sched.get_last_lr()[0]
            rep.step(step, loss, lr, tps, (cfg.total_steps - step) * B * cfg.seq_len / max(tps, 1e-9))
            metrics = {"loss": loss, "lr": lr, "tokens_per_s": tps, "block_size": noise.block_size}
            if eval_rows is not None and cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.total_steps):
                metrics["eval_loss"] = evaluate()
                evals.append((step, metrics["eval_loss"]))
                rep.log(f"step {step}: eval loss {metrics['eval_loss']:.4f}")
            if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.total_steps:
                checkpoint()
            if on_step is not None:
                on_step(step, metrics)
        _check_finite_weights(model, step)
        model_dir = export_run(cfg, tm, out, tokenizer_dir, rep) if ctx.main else None
        ctx.barrier()
    finally:
        rep.close()
    tokens = B * cfg.seq_len * len(losses)
    return TrainResult(out, model_dir, step, losses, evals, tokens / train_time if train_time else 0.0, model)

def _diverged(step: int, what: str, sched) -> str:
    return (f"training diverged at step {step}: {what} (lr {sched.get_last_lr()[0]:.2e}); stopped without saving "
            "these weights (the last checkpoint and model/ are untouched): lower the lr or raise the warmup")


def _check_finite_weights(model: nn.Module, step: int) -> None:
    """The last step's update can overflow the weights while the loss that preceded it was finite."""
    for name, p in model.named_parameters():
        if p.requires_grad and not bool(torch.isfinite(p).all()):
            raise TrainDivergedError(f"training diverged at step {step}: weight {name} is not finite; stopped "
                                     "without saving it (the last checkpoint and model/ are untouched): lower the lr")


# ------------------------------------------------------------------ entry points


def train(cfg: TrainConfig, data: str | Path, tokenizer_dir: str | Path, *, init_from: str | Path | None = None,
          on_step: Callable[[int, dict], None] | None = None) -> TrainResult:
    """Pre-train a fresh unmask model (shape `cfg.model`) on a corpus, or continue `init_from`.

    data: a corpus directory with train.jsonl (+ heldout.jsonl for eval), documents
    {"source", "path", "text"}; or the same with train.npy/heldout.npy token streams; or one
    .jsonl / .npy file. Documents are separated by <|endoftext|> (EOS if the tokenizer lacks it)
    and packed into rows of cfg.seq_len tokens.
    """
    ctx = prepare_run(cfg)
    try:
        for name in ("causal_context", "corrupt_fraction"):  # the CLI sets them after the config's own checks
            if cfg.objective == "causal" and getattr(cfg, name):
                raise TrainConfigError(f"{name} is a diffusion setting; objective 'causal' masks nothing")
        tok = Tokenizer(tokenizer_dir)
        ids = _special_ids(tok)
        sep = ids["endoftext"] if ids["endoftext"] is not None else ids["eos"]
        # every rank reads (or tokenizes into the same atomic cache) on its own: no rank can
        # fail while another waits for it
        log = print if ctx.main else (lambda _: None)
        rows, eval_rows = load_pretraining(Path(data), tok, cfg.seq_len, sep, Path(cfg.out_dir) / "tokens", log=log)
        if cfg.long_documents or cfg.passkey_fraction:
            from unmask.train.long_context import long_context_rows

            rows = long_context_rows(Path(data), tok, len(tok.hf), cfg.seq_len, sep, rows, cfg.long_documents,
                                     cfg.passkey_fraction, cfg.seed, log)
        sizes = cfg.block_sizes or DEFAULT_BLOCK_SIZES
        if init_from is not None:
            tm = load_trainable(init_from)
            check_same_tokenizer(tok, Path(tokenizer_dir), Path(init_from))
        else:
            if ids["mask"] is None:
                raise DataError(f"tokenizer {tokenizer_dir} has no mask token (<|mask|>)")
            stops = [i for i in (ids["eos"], ids["im_end"], ids["endoftext"]) if i is not None]
            vocab = -(-len(tok.hf) // 64) * 64
            # a fresh model's context covers the rows it is trained on
            shape = dataclasses.replace(cfg.model, max_position=max(cfg.model.max_position, cfg.seq_len))
            config = shape_config(shape, vocab, ids["mask"], [ids["eos"]], ids["bos"], ids["pad"], list(sizes))
            gen = {"eos_token_id": stops, "bos_token_id": ids["bos"], "pad_token_id": ids["pad"]}
            tm = fresh_model(config, gen, cfg.seed)
        check_vocab(tm, rows)
        if cfg.rope_scaling:
            from unmask.train.long_context import scale_rope

            scale_rope(tm, cfg.rope_scaling, cfg.seq_len)
        if cfg.objective == "causal":
            if tm.family.shift_key is None and not tm.family.shifted(tm.config):
                raise TrainConfigError(f"objective 'causal': the {tm.family.name} family has no shifted-logits "
                                       "form to continue from it with block diffusion")
            if tm.family.shift_key is not None:
                tm.config[tm.family.shift_key] = True  # the export reads logits at i as token i+1
            obj = Objective(mask_id=tm.mask_id, shift=True, causal=True)
        else:
            obj = _objective(tm, sizes, cfg)
        if cfg.position_span:
            obj = dataclasses.replace(obj, position_span=_position_span(tm, cfg.position_span, cfg.seq_len))
        res = run(cfg, _maybe_lora(tm, cfg), obj, rows, eval_rows, Path(tokenizer_dir), ctx, on_step)
    except BaseException:
        finish_run(ctx, failed=True)
        raise
    finish_run(ctx)
    return res


def finetune(cfg: TrainConfig, model_dir: str | Path, jsonl_path: str | Path, *, eval_path: str | Path | None = None,
             mix_text: str | Path | None = None, on_step: Callable[[int, dict], None] | None = None) -> TrainResult:
    """Supervised fine-tuning of any supported checkpoint on chat / FIM JSONL (see `unmask.train.sft`).

    Loss on assistant turns (and FIM middles) plus the EOS padding after them; prompts are never
    noised. The export in out_dir/model keeps the family's own format and tokenizer files.
    `mix_text` (a corpus as `train` takes it) with `cfg.mix_fraction` > 0 replays plain text rows
    among the chat rows, so that fine-tuning does not erase raw-text completion; with `cfg.long_documents` /
    `cfg.passkey_fraction` those rows are `train`'s long-context rows (whole packages, passkey retrieval).
    """
    if (cfg.long_documents or cfg.passkey_fraction) and not (mix_text is not None and cfg.mix_fraction > 0):
        raise TrainConfigError("long_documents and passkey_fraction shape the replayed text rows of fine-tuning: "
                               "give them with mix_text")
    if cfg.objective != "diffusion":
        raise TrainConfigError("fine-tuning trains the diffusion objective; objective 'causal' is for `train`")
    ctx = prepare_run(cfg)
    try:
        tm = load_trainable(model_dir)
        tok = Tokenizer(model_dir)
        enc = SFTEncoder(tok, tm.eos_id, tm.stop_ids)
        rows, _ = load_sft(jsonl_path, enc, cfg.seq_len, cfg.on_error, cfg.sft_pack)
        eval_rows = load_sft(eval_path, enc, cfg.seq_len, cfg.on_error, cfg.sft_pack)[0] if eval_path else None
        if mix_text is not None and cfg.mix_fraction > 0:
            ids = _special_ids(tok)
            sep = ids["endoftext"] if ids["endoftext"] is not None else tm.eos_id
            log = print if ctx.main else (lambda _: None)
            text, _ = load_pretraining(Path(mix_text), tok, cfg.seq_len, sep, Path(cfg.out_dir) / "tokens", log=log)
            if cfg.long_documents or cfg.passkey_fraction:  # a long-context model keeps what it learnt of distance
                from unmask.train.long_context import long_context_rows

                text = long_context_rows(Path(mix_text), tok, len(tok.hf), cfg.seq_len, sep, text,
                                         cfg.long_documents, cfg.passkey_fraction, cfg.seed, log)
            rows = mix_rows(rows, text, cfg.mix_fraction, cfg.seed)
        check_vocab(tm, rows)
        sizes = cfg.block_sizes or tuple(tm.config.get("train_block_sizes") or [tm.block_size])
        res = run(cfg, _maybe_lora(tm, cfg), _objective(tm, sizes, cfg), rows, eval_rows, None, ctx, on_step)
    except BaseException:
        finish_run(ctx, failed=True)
        raise
    finish_run(ctx)
    return res


def _special_ids(tok) -> dict[str, int | None]:
    hf = tok.hf
    return {"eos": hf.eos_token_id, "bos": hf.bos_token_id, "pad": hf.pad_token_id,
            "mask": hf.mask_token_id if hf.mask_token_id is not None else tok.token_id("<|mask|>"),
            "im_end": tok.token_id("<|im_end|>"), "endoftext": tok.token_id("<|endoftext|>")}


def _objective(tm: TrainableModel, sizes: tuple[int, ...], cfg: TrainConfig) -> Objective:
    """The model's objective; `cfg.causal_context` switches a shifted block-causal model to a causal context
    and records it in the exported config (a model that has it keeps it: its engine reads it)."""
    if tm.mask_id >= tm.arch.vocab_size:
        raise DataError(f"mask token id {tm.mask_id} is outside the vocabulary ({tm.arch.vocab_size})")
    block = None if tm.family.attention == "bidirectional" else tuple(sizes)
    shift = tm.family.shifted(tm.config)
    causal_context = tm.family.causal_context(tm.config)
    if cfg.causal_context and not causal_context:
        if tm.family.context_key is None or block is None or not shift:
            raise TrainConfigError(f"causal_context needs a shifted block-causal model of a family that records it "
                                   f"(unmask, from a causal base); {tm.family.name} "
                                   f"{'is not shifted' if tm.family.context_key and not shift else 'has no such form'}")
        tm.config[tm.family.context_key] = causal_context = True
    if cfg.anchor_weight and not causal_context:
        raise TrainConfigError(f"anchor_weight holds the next-token rows of a model with a causal context (what "
                               f"policy speculative reads); this {tm.family.name} model has none")
    for name in ("suffix_fraction", "full_block_fraction"):
        if getattr(cfg, name) and block is None:
            raise TrainConfigError(f"{name} shapes the masks of blocks; {tm.family.name} is not block-causal")
    return Objective(mask_id=tm.mask_id, block_sizes=block, shift=shift, causal_context=causal_context,
                     next_token_weight=cfg.next_token_weight if causal_context else 0.0,
                     suffix_fraction=cfg.suffix_fraction, confidence_weight=cfg.confidence_weight,
                     full_block_fraction=cfg.full_block_fraction, corrupt_fraction=cfg.corrupt_fraction,
                     vocab_size=tm.arch.vocab_size, anchor_weight=cfg.anchor_weight)


def _position_span(tm: TrainableModel, span: int, seq_len: int) -> int:
    """`--position-span` checked against the rows (it must be longer) and the context the model declares (after
    --rope-scaling): positions past it would train what serving never reaches."""
    if span <= seq_len:
        raise TrainConfigError(f"position_span must be 0 (off) or longer than seq_len {seq_len}, got {span}")
    declared = tm.config.get("max_position_embeddings")
    if declared is not None and span > int(declared):
        raise TrainConfigError(f"position_span {span:,} is past the model's context (max_position_embeddings "
                               f"{int(declared):,}); raise it with --rope-scaling")
    return span


def _maybe_lora(tm: TrainableModel, cfg: TrainConfig) -> TrainableModel:
    if cfg.lora_rank > 0:
        apply_lora(tm, cfg.lora_rank, cfg.lora_alpha)
    if cfg.draft_adapter_rank > 0:
        apply_draft_adapter(tm, cfg.draft_adapter_rank, cfg.lora_alpha, cfg.seed)
    return tm
