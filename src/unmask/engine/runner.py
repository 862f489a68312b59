"""Runs one forward over every planned request: flat tokens, ragged attention, selected logits."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from unmask.engine.sequence import StepPlan
from unmask.models.attention import AttentionBatch, commit_cache_lengths
from unmask.models.transformer import DiffusionTransformer


@dataclass
class RunnerOutput:
    logits: list[Tensor]   # per plan: [m_i, V] float32
    forward_s: float       # time inside the model (incl. the output head)
    num_tokens: int


class ModelRunner:
    def __init__(self, model: DiffusionTransformer):
        self.model = model
        self.device = model.lm_head.weight.device

    @torch.no_grad()  # not inference_mode: policies edit the returned logits in place
    def execute(self, plans: list[StepPlan]) -> RunnerOutput:
        dev = self.device
        ids = torch.cat([p.token_ids for p in plans]).to(dev, non_blocking=True)
        pos = torch.cat([p.positions for p in plans]).to(dev, non_blocking=True)
        batch = AttentionBatch([p.segment for p in plans])
        for seg in batch.segments:
            if seg.block_ids is not None:
                seg.block_ids = seg.block_ids.to(dev)
        batch.prepare()
        rows, counts, offset = [], [], 0
        for p in plans:
            rows.append(p.logit_rows + offset)
            counts.append(p.logit_rows.numel())
            offset += p.segment.length
        t0 = time.perf_counter()
        hidden = self.model(ids, pos, batch)
        flat_rows = torch.cat(rows).to(dev)
        logits = self.model.logits(hidden[flat_rows]) if flat_rows.numel() else hidden.new_empty(0, 0).float()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        forward_s = time.perf_counter() - t0
        commit_cache_lengths(batch)
        if not getattr(self.model, "keep_logits_on_device", False):  # DiffusionGemma samples on the device
            logits = logits.cpu()
        return RunnerOutput(list(logits.split(counts)), forward_s, int(ids.numel()))
