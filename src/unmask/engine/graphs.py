"""Replay a repeated denoising forward as a CUDA graph.

A canvas is denoised by up to `steps` forwards of the same shape: the same requests, the same cached prefix,
the same positions; only the canvas tokens and the self-conditioning logits change. On a GPU such a forward
of a small batch is launch overhead (measured on an H200 with a 167M-parameter DiffusionGemma: ~1,000 kernel
launches and ~34 ms of wall time per step against ~2.5 ms of kernel time), so once a step's exact shape has
run eagerly (the warm-up), the next step with that shape is captured and every later one replays it: the
inputs are copied into the graph's own buffers and one launch runs the whole forward and the output head.

A step qualifies when every request in it is a decoder-only canvas step with self-conditioning logits over
a KV cache (the model declares `graph_decode_steps`); anything else (prefill, a canvas's first step, a
finished canvas's encoder pass riding along) runs eagerly. The key names every address and offset the
captured kernels read (cache buffers, window base, positions), so a replay reads exactly what an eager
forward would. Off the GPU the same bookkeeping runs with the forward re-executed on the static buffers
(`emulate`), which is how the tests check it.
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from unmask.models.attention import AttentionBatch, Segment

log = logging.getLogger("unmask.engine")


def graphs_requested(explicit: bool | None = None) -> bool:
    """An engine option (`--cuda-graphs/--no-cuda-graphs`) wins; else UNMASK_CUDA_GRAPHS (on unless 0/false/no/off)."""
    if explicit is not None:
        return explicit
    return os.environ.get("UNMASK_CUDA_GRAPHS", "1").lower() not in ("0", "false", "no", "off")


def graphs_enabled(model: torch.nn.Module, device: torch.device, explicit: bool | None = None) -> bool:
    """On by default for models that declare graph-safe decoder steps on CUDA; UNMASK_CUDA_GRAPHS=0 turns off."""
    if not graphs_requested(explicit):
        return False
    return device.type == "cuda" and bool(getattr(model, "graph_decode_steps", False))


@dataclass
class _Graph:
    ids: Tensor            # [N] static input buffer (positions are fixed by the key)
    sc: list[Tensor]       # per segment [length, V]
    out: Tensor            # [N, V] logits, written by each replay
    replay: Callable[[], None]


class DecodeGraphs:
    """Captured decoder steps, keyed by everything their kernels read; least recently used dropped first."""

    def __init__(self, model: torch.nn.Module, device: torch.device, max_graphs: int = 8,
                 max_bytes: int = 1 << 30, emulate: bool = False):
        self.model = model
        self.device = device
        self.max_graphs = max_graphs
        # each graph keeps its logits buffer ([canvas rows, V] float32: 268 MB for one 256-token canvas of a
        # 262K vocabulary), so the count alone does not bound memory; the newest graph is always kept
        self.max_bytes = max_bytes
        self.emulate = emulate
        self.enabled = True
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.seen: OrderedDict[tuple, None] = OrderedDict()  # keys that ran eagerly once (warmed up)
        self.pool = None if emulate else torch.cuda.graph_pool_handle()
        self.captures = self.replays = 0

    # ------------------------------------------------------------------ keys
    @staticmethod
    def key(batch: AttentionBatch, counts: list[int]) -> tuple | None:
        """None unless every segment is a canvas-only step with self-conditioning over a cache, all rows read."""
        parts = []
        for seg, m in zip(batch.segments, counts):
            extra = seg.extra or {}
            sc = extra.get("sc_logits")
            cache = seg.cache
            if (cache is None or sc is None or extra.get("encoder", seg.length) != 0 or seg.write
                    or seg.block_ids is not None or seg.suffix or m != seg.length):
                return None
            # addresses and shapes both: a freed cache's memory (and its Python id) can come back with other rows
            parts.append((id(cache), seg.start, seg.length, getattr(cache, "base", 0), tuple(sc.shape), sc.dtype,
                          tuple((t.data_ptr(), t.shape) for t in cache.k),
                          tuple((t.data_ptr(), t.shape) for t in cache.v)))
        return tuple(parts)

    # ------------------------------------------------------------------ running
    def run(self, key: tuple, ids: Tensor, positions: Tensor, batch: AttentionBatch) -> Tensor | None:
        """Logits [N, V] from a replay (a fresh tensor), or None: run this step eagerly."""
        g = self.graphs.get(key)
        if g is None:
            if key not in self.seen:  # first sighting: the eager step is the warm-up
                self.seen[key] = None
                if len(self.seen) > 4 * self.max_graphs:
                    self.seen.popitem(last=False)
                return None
            del self.seen[key]
            g = self._capture(key, ids, positions, batch)
            if g is None:
                return None
        else:
            self.graphs.move_to_end(key)
        g.ids.copy_(ids, non_blocking=True)  # positions need no copy: the key fixes each segment's start and length
        for buf, seg in zip(g.sc, batch.segments):
            buf.copy_(seg.extra["sc_logits"].reshape(buf.shape), non_blocking=True)
        g.replay()
        self.replays += 1
        return g.out.clone()  # the policies edit logits in place and keep them across steps

    def _capture(self, key: tuple, ids: Tensor, positions: Tensor, batch: AttentionBatch) -> _Graph | None:
        dev = self.device
        static_ids, static_pos = ids.to(dev).clone(), positions.to(dev).clone()
        sc = [s.extra["sc_logits"].reshape(s.length, -1).to(dev).clone() for s in batch.segments]
        segs = AttentionBatch([Segment(start=s.start, length=s.length, write=0, cache=s.cache,
                                       extra={**s.extra, "sc_logits": b}) for s, b in zip(batch.segments, sc)])

        def forward() -> Tensor:
            return self.model.logits(self.model(static_ids, static_pos, segs))

        if self.emulate:
            holder = {"out": forward()}

            def replay() -> None:
                holder["out"].copy_(forward())

            g = _Graph(static_ids, sc, holder["out"], replay)
        else:
            try:
                graph = torch.cuda.CUDAGraph()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up on a side stream, refusing anything that syncs
                    prev = torch.cuda.get_sync_debug_mode()
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        forward()
                    finally:
                        torch.cuda.set_sync_debug_mode(prev)
                torch.cuda.current_stream().wait_stream(side)
                with torch.cuda.graph(graph, pool=self.pool):
                    out = forward()
            except Exception as e:  # an op this build cannot capture: eager from now on, for this engine
                self.enabled = False
                log.warning("CUDA graphs off for this engine (capture failed: %s)", str(e).splitlines()[0][:200])
                return None
            g = _Graph(static_ids, sc, out, graph.replay)
        self.graphs[key] = g
        self.captures += 1
        while len(self.graphs) > 1 and (len(self.graphs) > self.max_graphs or self.held_bytes() > self.max_bytes):
            self.graphs.popitem(last=False)
        return g

    def held_bytes(self) -> int:
        return sum(g.out.numel() * g.out.element_size() for g in self.graphs.values())
