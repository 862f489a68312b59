"""The processes of a training run and what it prints: the DDP group (one code path for 1..N processes) and the
progress reporter (a live rich bar on a terminal, plain lines in a log, silent off rank 0)."""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from unmask.train.config import TrainConfig


@dataclass
class _Dist:
    rank: int
    world: int
    device: torch.device
    owns_group: bool
    created: Path | None = None        # the folder this run created for out_dir (removed if it fails early)
    started: bool = False              # the first training step has begun

    @property
    def main(self) -> bool:
        return self.rank == 0

    def sum(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def _init_dist(device: str) -> _Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    owns = False
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
        owns = True
    rank = dist.get_rank() if world > 1 else 0
    dev = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if device == "cuda" else device)
    return _Dist(rank, world, dev, owns)


class _Reporter:
    """A live rich progress bar on a terminal, plain log lines otherwise; silent off rank 0."""

    def __init__(self, cfg: TrainConfig, enabled: bool, start: int):
        self.every, self.total, self.start = cfg.log_every, cfg.total_steps, start
        mode = cfg.progress if enabled else "none"
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        self.mode, self.bar = mode, None
        if mode == "rich":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            self.bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
                                TextColumn("eta"), TimeRemainingColumn())
            self.task = self.bar.add_task("train", total=self.total, completed=start, loss=float("nan"), tps=0.0)
            self.bar.start()

    def log(self, msg: str) -> None:
        if self.mode == "rich":
            self.bar.console.print(msg)
        elif self.mode == "plain":
            print(msg, flush=True)

    def step(self, step: int, loss: float, lr: float, tps: float, eta_s: float) -> None:
        if self.mode == "rich":
            self.bar.update(self.task, completed=step, loss=loss, tps=tps)
        elif self.mode == "plain" and (step % self.every == 0 or step == self.total):
            eta = time.strftime("%H:%M:%S", time.gmtime(max(0.0, eta_s)))
            print(f"step {step}/{self.total} loss {loss:.4f} lr {lr:.2e} {tps:,.0f} tok/s eta {eta}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
