"""Runs one forward over every planned request: flat tokens, ragged attention, selected logits."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor

from unmask.engine.graphs import DecodeGraphs, graphs_enabled
from unmask.engine.sequence import StepPlan
from unmask.models.attention import AttentionBatch, commit_cache_lengths
from unmask.models.transformer import DiffusionTransformer


@dataclass
class RunnerOutput:
    logits: list[Tensor]   # per plan: [m_i, V] float32 (or a decoding.sampling.Proposal from the static step)
    forward_s: float       # time inside the model (incl. the output head)
    num_tokens: int


class ForwardTimer:
    """Time spent in forwards. On the host clock off CUDA; on CUDA by device events read back once they have
    completed, so timing never synchronises: the host goes on to queue the denoising step while the device
    runs the forward. A step then reports the forwards that finished by the time it ends (they lag by a
    step or so; `settle` collects the rest)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: deque = deque()
        self.t0 = 0.0
        self._start = None

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        if not self.cuda:
            return time.perf_counter() - self.t0
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.pending.append((self._start, end))
        return self._collect(wait=len(self.pending) > 64)

    def settle(self) -> float:
        return self._collect(wait=True) if self.cuda else 0.0

    def _collect(self, wait: bool) -> float:
        total = 0.0
        while self.pending and (wait or self.pending[0][1].query()):
            start, end = self.pending.popleft()
            end.synchronize()
            total += start.elapsed_time(end) / 1000
        return total


class ModelRunner:
    def __init__(self, model: DiffusionTransformer, static=None, cuda_graphs: bool | None = None, compiled=None):
        """static: an engine.static_step.StaticStep, which takes the steps whose shape fits its buffers;
        cuda_graphs: replay repeated canvas steps as CUDA graphs (None: UNMASK_CUDA_GRAPHS); compiled: an
        engine.compiled_step.CompiledStep, which runs the CPU steps whose shape it takes."""
        self.model = model
        self.static = static
        self.compiled = compiled
        self.device = model.lm_head.weight.device
        on = graphs_enabled(model, self.device, cuda_graphs)
        self.graphs = DecodeGraphs(model, self.device) if on else None
        self.timer = ForwardTimer(self.device)

    def settle_timing(self) -> float:
        """Forward seconds not yet reported (on CUDA: waits for the queued forwards); call when idle."""
        return self.timer.settle()

    @torch.no_grad()  # not inference_mode: policies edit the returned logits in place
    def execute(self, plans: list[StepPlan]) -> RunnerOutput:
        if self.static is not None:
            self.timer.start()
            out = self.static.execute(plans)  # per plan logits, or the greedy proposals made on the device
            if out is not None:
                return RunnerOutput(out, self.timer.stop(), sum(p.segment.length for p in plans))
        dev = self.device
        # token ids may already be on the device (a canvas step of a family that samples there)
        ids = torch.cat([p.token_ids.to(dev, non_blocking=True) for p in plans])
        pos = torch.cat([p.positions for p in plans])  # on the host: a graph replay needs none (its key fixes them)
        batch = AttentionBatch([p.segment for p in plans])
        for seg in batch.segments:
            if seg.block_ids is not None:
                seg.block_ids = seg.block_ids.to(dev)
            if seg.attend is not None:
                seg.attend = seg.attend.to(dev)
        batch.prepare()
        rows, counts, offset = [], [], 0
        for p in plans:
            rows.append(p.logit_rows + offset)
            counts.append(p.logit_rows.numel())
            offset += p.segment.length
        self.timer.start()
        logits = None
        if self.graphs is not None and self.graphs.enabled:
            key = self.graphs.key(batch, counts)
            if key is not None:
                logits = self.graphs.run(key, ids, pos, batch)
        if logits is None and self.compiled is not None:
            key = self.compiled.key(batch, counts)
            if key is not None:
                logits = self.compiled.run(key, ids, pos, batch, [p.logit_rows for p in plans])
        if logits is None:
            hidden = self.model(ids, pos.to(dev, non_blocking=True), batch)
            flat_rows = torch.cat(rows).to(dev, non_blocking=True)
            logits = self.model.logits(hidden[flat_rows]) if flat_rows.numel() else hidden.new_empty(0, 0).float()
        forward_s = self.timer.stop()
        commit_cache_lengths(batch)
        if not getattr(self.model, "keep_logits_on_device", False):  # DiffusionGemma samples on the device
            logits = logits.cpu()
        return RunnerOutput(list(logits.split(counts)), forward_s, int(ids.numel()))
