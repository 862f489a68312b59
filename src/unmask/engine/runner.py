"""Runs one forward over every planned request: flat tokens, ragged attention, selected logits."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from unmask.engine.graphs import DecodeGraphs, graphs_enabled
from unmask.engine.sequence import StepPlan
from unmask.models.attention import AttentionBatch, commit_cache_lengths
from unmask.models.transformer import DiffusionTransformer


@dataclass
class RunnerOutput:
    logits: list[Tensor]   # per plan: [m_i, V] float32
    forward_s: float       # time inside the model (incl. the output head)
    num_tokens: int


class ModelRunner:
    def __init__(self, model: DiffusionTransformer, graphs: DecodeGraphs | None = None):
        self.model = model
        self.device = model.lm_head.weight.device
        self.graphs = graphs if graphs is not None else (
            DecodeGraphs(model, self.device) if graphs_enabled(model, self.device) else None)

    @torch.no_grad()  # not inference_mode: policies edit the returned logits in place
    def execute(self, plans: list[StepPlan]) -> RunnerOutput:
        dev = self.device
        # token ids may already be on the device (a canvas step of a family that samples there)
        ids = torch.cat([p.token_ids.to(dev, non_blocking=True) for p in plans])
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
        logits = None
        if self.graphs is not None and self.graphs.enabled:
            key = self.graphs.key(batch, counts)
            if key is not None:
                logits = self.graphs.run(key, ids, pos, batch)
        if logits is not None:
            # a replay is timed by the graphs' device events, without a sync: the host goes on to queue the
            # denoising step while the device runs the forward
            forward_s = self.graphs.take_device_seconds()
        else:
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
