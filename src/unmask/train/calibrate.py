"""Fit the learned commit rule (`unmask.decoding.commit_filter`) on a model's own decoding.

The data are the model's one-token-per-forward trajectories (`trajectories.py`, which records the forward that
committed each answer token). Replaying them block by block gives every state that reference decoder passed
through: in each block, the answer tokens committed before step s are in place and the rest are masked. One
two-stream pass per step s scores all blocks of a batch at once (block diffusion's attention mask gives each
block exactly the context the engine's exact cache gives it). Every masked position is one example: the
proposal's statistics as features, and as label whether its argmax already is the token the reference
committed there. A filter that commits only positions it predicts final keeps the decoder on the reference's
trajectory, so its output matches one token per forward wherever the filter is right.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from unmask.decoding.commit_filter import CONFIG_KEY, CommitFilter, feature_matrix, fit
from unmask.models.transformer import DiffusionTransformer
from unmask.train.objectives import Objective, head_logits, masked_rows
from unmask.train.trajectories import Trajectory


@dataclass
class ReplayRows:
    feats: Tensor   # [N, F] float32
    final: Tensor   # [N] bool: the proposal is the reference's token
    step: Tensor    # [N] long: the state (tokens of the block already committed) it was seen in


def _ranks(order: list[int], starts: list[int], block: int) -> list[int]:
    """Per answer token, how many answer tokens of its block the reference committed before it."""
    ranks = [0] * len(order)
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(starts):
        groups.setdefault(s // block, []).append(i)
    for members in groups.values():
        for r, i in enumerate(sorted(members, key=lambda i: (order[i], i))):
            ranks[i] = r
    return ranks


@torch.no_grad()
def replay(model: DiffusionTransformer, obj: Objective, trajs: list[Trajectory], block: int, pad_id: int,
           batch: int = 16) -> ReplayRows:
    """Features and labels of every masked answer position in every state of the reference's decoding."""
    if any(len(t.order) != len(t.answer) for t in trajs):
        raise ValueError("trajectories without a commit order (made before it was recorded): regenerate them")
    model.eval()
    dev = next(model.parameters()).device
    out_f, out_y, out_s = [], [], []
    for lo in range(0, len(trajs), batch):
        chunk = trajs[lo:lo + batch]
        L = -(-max(len(t.prompt) + len(t.answer) for t in chunk) // block) * block
        ids = torch.full((len(chunk), L), pad_id, dtype=torch.long)
        rank = torch.full((len(chunk), L), -1, dtype=torch.long)   # -1: not an answer token
        tail = torch.zeros(len(chunk), L, dtype=torch.bool)        # after the answer, inside its last block
        for r, t in enumerate(chunk):
            P, A = len(t.prompt), len(t.answer)
            ids[r, :P + A] = torch.tensor(t.prompt + t.answer)
            rank[r, P:P + A] = torch.tensor(_ranks(t.order, list(range(P, P + A)), block))
            tail[r, P + A:-(-(P + A) // block) * block] = True
        ids, rank, tail = ids.to(dev), rank.to(dev), tail.to(dev)
        n_groups = len(chunk) * (L // block)
        initial = ((rank >= 0) | tail).view(n_groups, block).sum(1)  # each block's masks when it started
        for s in range(block):
            target = rank >= s
            if not bool(target.any()):
                break
            # a block's tail stays masked while any of its answer tokens is (the engine's canvas is masked there)
            blk = (torch.arange(L, device=dev) // block).expand_as(rank)
            open_blocks = torch.zeros(len(chunk), L // block, dtype=torch.bool, device=dev)
            open_blocks.scatter_reduce_(1, blk, target, reduce="amax")
            masked = target | (tail & open_blocks.gather(1, blk))
            hidden, b, j, src = masked_rows(model, ids, masked, obj, block)
            logits = head_logits(model, hidden[b, src])
            logits[:, obj.mask_id] = float("-inf")
            logp = F.log_softmax(logits, -1)
            top2 = logp.topk(2, dim=-1)
            probs = top2.values[:, 0].exp()
            margin = probs - top2.values[:, 1].exp()
            entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
            group = b * (L // block) + j // block
            offs = j % block
            first = torch.full((n_groups,), block, dtype=torch.long, device=dev).scatter_reduce(
                0, group, offs, reduce="amin")
            count = torch.bincount(group, minlength=n_groups)
            feats = feature_matrix(probs, margin, entropy, offs - first[group], count[group] / initial[group])
            keep = target[b, j]
            out_f.append(feats[keep].cpu())
            out_y.append((logits.argmax(-1) == ids[b, j])[keep].cpu())
            out_s.append(torch.full((int(keep.sum()),), s, dtype=torch.long))
    return ReplayRows(torch.cat(out_f), torch.cat(out_y), torch.cat(out_s))


def threshold_table(flt: CommitFilter, rows: ReplayRows, thresholds=(0.5, 0.7, 0.8, 0.9, 0.95)) -> list[dict]:
    """For each threshold: the share of masked positions the filter would commit, and how many of those are
    final (its precision), over the replayed states."""
    p = flt.prob(rows.feats)
    table = []
    for t in thresholds:
        pick = p >= t
        n = int(pick.sum())
        table.append({"threshold": t, "committed_share": n / max(len(p), 1),
                      "precision": float(rows.final[pick].float().mean()) if n else None})
    return table


def calibrate(model: DiffusionTransformer, obj: Objective, trajs: list[Trajectory], block: int,
              pad_id: int) -> tuple[CommitFilter, dict]:
    rows = replay(model, obj, trajs, block, pad_id)
    flt, stats = fit(rows.feats, rows.final)
    stats["thresholds"] = threshold_table(flt, rows)
    # the confidence rule on the same states, for comparison: p(x0) >= 0.9
    conf = torch.sigmoid(rows.feats[:, 0])
    pick = conf >= 0.9
    stats["confidence_0.9"] = {"committed_share": float(pick.float().mean()),
                               "precision": float(rows.final[pick].float().mean()) if bool(pick.any()) else None}
    return flt, stats


def write_filter(model_dir: Path, flt: CommitFilter, stats: dict) -> Path:
    """Store the filter in the model's generation_config.json (where decoding defaults live), atomically."""
    path = model_dir / "generation_config.json"
    gc = json.loads(path.read_text()) if path.is_file() else {}
    gc[CONFIG_KEY] = {**flt.to_json(), "fit": {k: v for k, v in stats.items() if k != "thresholds"}}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(gc, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def calibrate_model(model_dir: str | Path, text: Path | None, chat: Path | None, prompts: int = 128,
                    answer_tokens: int = 64, max_prompt: int = 192, block: int | None = None, seed: int = 0,
                    device: str = "auto", log=print) -> tuple[CommitFilter, dict]:
    """Generate the model's own one-token-per-forward answers to `prompts` prompts, replay them, fit the filter."""
    from unmask.engine.llm import LLM
    from unmask.train.sft import SFTEncoder
    from unmask.train.trajectories import TrajectoryConfig, draw_prompts, generate

    # one float32 copy serves both the decoding and its replay (which needs no gradients)
    llm = LLM(model_dir, dtype="float32", device=device)
    spec = llm.spec
    if spec.family.attention != "block_causal" or spec.family.sequence_class is not None:
        raise ValueError(f"calibrate replays block-causal decoding; {spec.family.name} is not block-causal")
    if spec.eos_id is None:
        raise ValueError(f"{spec.path}: no eos_token_id in config.json or generation_config.json")
    block = block or spec.block_size
    traj_cfg = TrajectoryConfig(prompts=prompts, max_tokens=answer_tokens, block_size=block, seed=seed)
    max_prompt = min(max_prompt, spec.max_context - answer_tokens)
    if max_prompt < 1:
        raise ValueError(f"answer_tokens {answer_tokens} leaves no room for a prompt in the model's context "
                         f"({spec.max_context})")
    drawn = draw_prompts(traj_cfg, llm.tokenizer, text, chat, SFTEncoder(llm.tokenizer, spec.eos_id, spec.stop_ids),
                         max_prompt)
    trajs, cost = generate(llm.engine, drawn, traj_cfg.params())
    log(f"calibrate: {len(trajs)} answers, {cost.answer_tokens:,} tokens in {cost.seconds:.0f} s; replaying them")
    obj = Objective(mask_id=spec.mask_id, block_sizes=(block,), shift=spec.shift, causal_context=spec.causal_context)
    flt, stats = calibrate(llm.model, obj, trajs, block, spec.eos_id)
    stats.update(prompts=len(trajs), block_size=block, answer_tokens=cost.answer_tokens)
    return flt, stats
