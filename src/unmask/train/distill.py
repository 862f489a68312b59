"""Distillation for parallel decoding: train a model on a teacher's own answers so it commits many tokens per forward.

Why it works: a masked-diffusion model trained on real text spreads its probability over every way a block
could continue, so under a confidence threshold it is sure of about one position at a time. The answers a
teacher decodes greedily are a deterministic function of their prompt; trained on them (the same block
diffusion objective, prompts never noised), the student can become sure of several positions of a block at
once, and certainty forcing (`confidence_weight`, dParallel, czg1225/dParallel) pushes the positions it
already predicts right to high confidence sooner. The default teacher is the model itself decoded one token
per forward, the quality the distilled model is held to (self-distillation, as dParallel does on LLaDA).

The run is `finetune`'s loop (`trainer.run`: the same data checks, progress, exact --resume, DDP, LoRA and
export); what it adds is the trajectory cache (`trajectories.py`) and `distill.json`, which counts the
teacher's and the student's compute so a comparison with an autoregressive twin can give both sides the same
budget or say exactly what each got.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from unmask.tokenizer import Tokenizer
from unmask.train.corpus import corpus_file
from unmask.train.data import DataError, TokenRows, check_vocab, load_pretraining, mix_rows
from unmask.train.model_init import count_params, load_trainable
from unmask.train.sft import SFTEncoder
from unmask.train.run_dir import finish_run, prepare_run
from unmask.train.trainer import (TrainConfig, TrainConfigError, TrainResult, _maybe_lora, _objective, _special_ids,
                                  run)
from unmask.train.trajectories import (FORMAT, TeacherCost, Trajectory, TrajectoryCache, TrajectoryConfig,
                                       draw_prompts, generate_missing, read_all, tokenizer_digest, weights_digest)

REPORT = "distill.json"
EVAL_SHARE = 0.03  # of the trajectories, held out for the eval loss (at least EVAL_MIN when there are enough)
EVAL_MIN = 8


def trajectory_rows(trajs: list[Trajectory], seq_len: int, pad_id: int) -> TokenRows:
    """One trajectory a row, prompt first at position 0 (as the engine lays a request out, so blocks align as
    they do at inference), loss on the answer. An answer that stopped is padded with `pad_id` in the loss (the
    model learns nothing follows, as SFT does); one cut at max_tokens is padded outside the loss."""
    ids_rows, mask_rows = [], []
    for t in trajs:
        ids = (t.prompt + t.answer)[:seq_len]
        mask = ([False] * len(t.prompt) + [True] * len(t.answer))[:seq_len]
        if not any(mask):
            continue
        pad = seq_len - len(ids)
        ids_rows.append(ids + [pad_id] * pad)
        mask_rows.append(mask + [t.finish == "stop"] * pad)
    if not ids_rows:
        raise DataError("no trajectory has an answer token inside seq_len")
    return TokenRows(torch.tensor(ids_rows, dtype=torch.int32), torch.tensor(mask_rows, dtype=torch.bool))


def _say(msg: str) -> None:
    print(msg, flush=True)  # progress of a long background run must reach its log file as it happens


def _file_digest(path: Path | None) -> str | None:
    """Identity of a prompt source: a hash of its bytes (tens of MB: well under a second), so a rebuilt but
    identical corpus keeps the cache and a changed one is refused."""
    if path is None:
        return None
    file = corpus_file(path)
    h = hashlib.sha256()
    with open(file, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def _teacher_engine(teacher_dir: Path, device: torch.device, dtype: str | None):
    from unmask.engine.llm import LLM

    return LLM(teacher_dir, dtype=dtype, device=str(device)).engine


def distill(cfg: TrainConfig, model_dir: str | Path, traj: TrajectoryConfig, *, text: str | Path | None = None,
            chat: str | Path | None = None, teacher_dir: str | Path | None = None, teacher_dtype: str | None = None,
            mix_text: str | Path | None = None, on_step: Callable[[int, dict], None] | None = None) -> TrainResult:
    """Distil `model_dir` (full weights, or LoRA with cfg.lora_rank) on a teacher's answers to prompts from a text
    corpus (`text`) and / or chat / FIM records (`chat`). The teacher defaults to the model itself; its answers
    are cached in out_dir/trajectories and reused by --resume. Exports out_dir/model; writes out_dir/distill.json.
    """
    if cfg.objective != "diffusion":
        raise TrainConfigError("distillation trains the diffusion objective; objective 'causal' is for `train`")
    text = Path(text) if text is not None else None
    chat = Path(chat) if chat is not None else None
    ctx = prepare_run(cfg)
    log = _say if ctx.main else (lambda _: None)
    try:
        tm = load_trainable(model_dir)
        tok = Tokenizer(model_dir)
        if tm.family.attention == "bidirectional":
            raise TrainConfigError(f"distillation trains block-causal models (unmask, SDAR, Fast-dLLM v2, LLaDA2); "
                                   f"{tm.family.name} is bidirectional")
        teacher = Path(teacher_dir) if teacher_dir is not None else Path(model_dir)
        if teacher_dir is not None and tokenizer_digest(Tokenizer(teacher)) != tokenizer_digest(tok):
            raise DataError(f"teacher {teacher} numbers tokens differently from {model_dir}: a student learns "
                            "from the teacher's token ids, so both need one tokenizer")
        # the teacher's weights identify the cache; a self-distilled run's are the student's before training
        teacher_model = tm.model if teacher_dir is None else load_trainable(teacher).model
        teacher_weights, teacher_params = weights_digest(teacher_model), count_params(teacher_model)
        del teacher_model
        max_prompt = cfg.seq_len - traj.max_tokens - 1
        if max_prompt < 1:
            raise TrainConfigError(f"seq_len {cfg.seq_len} leaves no room for a prompt before {traj.max_tokens} "
                                   "answer tokens")
        prompts = draw_prompts(traj, tok, text, chat, SFTEncoder(tok, tm.eos_id, tm.stop_ids), max_prompt)
        identity = {"format": FORMAT, "teacher_weights": teacher_weights, "tokenizer": tokenizer_digest(tok),
                    "recipe": {**asdict(traj), "max_prompt": max_prompt},
                    "sources": {"text": _file_digest(text), "chat": _file_digest(chat)}}
        cache = TrajectoryCache(Path(cfg.out_dir) / "trajectories", identity)
        if ctx.main:
            cache.open()
        ctx.barrier()
        if not ctx.main:
            cache.open()  # checks what rank 0 wrote
        generate_missing(cache, prompts, traj.shard_size, lambda: _teacher_engine(teacher, ctx.device, teacher_dtype),
                         traj.params(), ctx.rank, ctx.world, log)
        ctx.barrier()
        trajs, teacher_cost = read_all(cache, prompts, traj.shard_size)
        log(f"trajectories: {len(trajs)} answers, {teacher_cost.answer_tokens:,} tokens, "
            f"{teacher_cost.answer_tokens / max(teacher_cost.forwards, 1):.2f} tokens/forward under the teacher's "
            f"policy, {sum(t.finish == 'stop' for t in trajs)} stopped by themselves")
        n_eval = max(EVAL_MIN, round(len(trajs) * EVAL_SHARE)) if len(trajs) >= 4 * EVAL_MIN else 0
        rows = trajectory_rows(trajs[n_eval:], cfg.seq_len, tm.eos_id)
        eval_rows = trajectory_rows(trajs[:n_eval], cfg.seq_len, tm.eos_id) if n_eval else None
        if mix_text is not None and cfg.mix_fraction > 0:
            ids = _special_ids(tok)
            sep = ids["endoftext"] if ids["endoftext"] is not None else tm.eos_id
            plain, _ = load_pretraining(Path(mix_text), tok, cfg.seq_len, sep, Path(cfg.out_dir) / "tokens", log=log)
            rows = mix_rows(rows, plain, cfg.mix_fraction, cfg.seed)
        check_vocab(tm, rows)
        sizes = cfg.block_sizes or tuple(tm.config.get("train_block_sizes") or [tm.block_size])
        obj = _objective(tm, sizes, cfg)
        n_params = count_params(tm.model)
        res = run(cfg, _maybe_lora(tm, cfg), obj, rows, eval_rows, None, ctx, on_step)
        if ctx.main:
            write_report(Path(cfg.out_dir), cfg, teacher, teacher_cost, teacher_params, n_params, res,
                         two_stream=obj.block_sizes is not None)
    except BaseException:
        finish_run(ctx, failed=True)
        raise
    finish_run(ctx)
    return res


def write_report(out: Path, cfg: TrainConfig, teacher: Path, cost: TeacherCost, teacher_params: int, n_params: int,
                 res: TrainResult, two_stream: bool) -> dict:
    """distill.json: what the teacher's answers and the student's training cost, in tokens and estimated FLOPs
    (2 N per position of a forward, 6 N per trained position: the usual dense-transformer estimate; the student's
    figure includes its anchor's forwards)."""
    positions = res.steps * cfg.batch_size * cfg.seq_len * (2 if two_stream else 1)  # [x_t ; x_0] rows
    # the anchor (anchor_weight): one forward of the starting model over each row's clean tokens
    anchor_flops = 2 * n_params * res.steps * cfg.batch_size * cfg.seq_len if cfg.anchor_weight else 0
    report = {
        "teacher": {"model": str(teacher), "parameters": teacher_params, **asdict(cost),
                    "tokens_per_forward": cost.answer_tokens / max(cost.forwards, 1),
                    "flops": 2 * teacher_params * cost.tokens_fed},
        "student": {"steps": res.steps, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
                    "trained_positions": positions, "flops": 6 * n_params * positions + anchor_flops,
                    "confidence_weight": cfg.confidence_weight, "lr": cfg.lr, "lora_rank": cfg.lora_rank,
                    "draft_adapter_rank": cfg.draft_adapter_rank, "anchor_weight": cfg.anchor_weight,
                    "anchor_flops": anchor_flops},
        "parameters": n_params,
    }
    report["total_flops"] = report["teacher"]["flops"] + report["student"]["flops"]
    (out / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    return report
