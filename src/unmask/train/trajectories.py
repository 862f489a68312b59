"""Teacher trajectories for distillation: prompts, the engine's answers to them, and their cache on disk.

A distillation run (`unmask.train.distill`) trains a model on what a teacher (by default the model itself,
decoded one token per forward) answers to prompts drawn from the training data. Those answers are the
expensive part, so they are generated once, batched through the engine, and kept in `out_dir/trajectories/`:
a `meta.json` naming the teacher's weights, tokenizer and settings, and numbered shards written atomically as
they finish. A resumed run reads the finished shards and generates only the rest; a cache made by another
teacher, tokenizer or recipe is refused with one line naming the mismatch.

Prompts mirror the tasks the model is judged on: code and prose cut at a line end (the next-line and
function-body tasks continue such a prefix), and the prompt half of chat / fill-in-the-middle records
(the chat and infill tasks).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from unmask.engine.engine import Engine
from unmask.engine.params import GenerationParams
from unmask.train.corpus import corpus_file, read_jsonl_objects
from unmask.train.data import DataError

META = "meta.json"
FORMAT = 2  # 2: trajectories record the teacher's commit order


@dataclass(frozen=True)
class TrajectoryConfig:
    """What the teacher answers and how; every field is part of the cache's identity."""

    prompts: int = 2048                 # prompts in all
    chat_fraction: float = 0.25         # share drawn from chat / FIM records (when a chat file is given)
    context_chars: int = 1200           # text prompts: up to this many characters before a line end
    min_context_chars: int = 64
    max_tokens: int = 64                # answer length (text prompts run to it unless the teacher stops)
    policy: str = "topk"                # the teacher's decoding: one token per forward by default,
    tokens_per_step: int | None = 1     # the quality reference the distilled model is held to
    threshold: float = 0.9
    block_size: int | None = None       # None: the teacher's default
    shard_size: int = 256               # prompts per shard (the unit a resumed run keeps)
    seed: int = 0

    def __post_init__(self):
        if self.prompts < 1:
            raise ValueError(f"prompts must be >= 1, got {self.prompts}")
        if not 0.0 <= self.chat_fraction <= 1.0:
            raise ValueError(f"chat_fraction must be in [0, 1], got {self.chat_fraction}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 < self.min_context_chars <= self.context_chars:
            raise ValueError(f"need 0 < min_context_chars <= context_chars, got {self.min_context_chars} and "
                             f"{self.context_chars}")
        if self.shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {self.shard_size}")

    def params(self) -> GenerationParams:
        return GenerationParams(max_tokens=self.max_tokens, temperature=0.0, policy=self.policy,
                                tokens_per_step=self.tokens_per_step, threshold=self.threshold,
                                block_size=self.block_size)


@dataclass
class Trajectory:
    prompt: list[int]
    answer: list[int]         # the teacher's tokens, its stop token included when it stopped
    kind: str                 # "text" or "chat"
    finish: str               # "stop" or "length"
    forwards: int             # forwards the request took part in (its share of the teacher's compute)
    order: list[int] = field(default_factory=list)  # per answer token: the forward that committed it


@dataclass
class TeacherCost:
    """What generating the trajectories cost (summed over shards, across resumes)."""

    requests: int = 0
    answer_tokens: int = 0
    forwards: int = 0          # per-request forwards, summed
    tokens_fed: int = 0        # positions the engine fed to the model (prefill + every denoising pass)
    seconds: float = 0.0

    def add(self, other: "TeacherCost") -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)


@dataclass
class Prompt:
    ids: list[int]
    kind: str


def tokenizer_digest(tok) -> str:
    """Identity of a tokenizer's numbering (its vocabulary), independent of file formatting."""
    vocab = sorted(tok.hf.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


def weights_digest(model: torch.nn.Module) -> str:
    """A short hash of a model's weights: names, shapes and a sample of each tensor (as LoRA resume checks its
    base), so a cache made by another model of the same shape is told apart without hashing gigabytes."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in sorted(model.state_dict().items()):
            flat = p.detach().reshape(-1)
            idx = torch.linspace(0, flat.numel() - 1, steps=min(256, flat.numel())).long()
            h.update(f"{name}:{tuple(p.shape)}".encode())
            h.update(flat[idx].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------ prompts

def text_prompts(path: Path, tok, n: int, cfg: TrajectoryConfig, rng: random.Random) -> list[Prompt]:
    """`n` prefixes of documents ending just before a newline (as the next-line tasks cut them), each at most
    `context_chars` characters, from a corpus directory (train.jsonl) or a JSONL file of {"text": ...}."""
    file = corpus_file(path)
    docs = [obj["text"] for _, obj in read_jsonl_objects(file) if isinstance(obj.get("text"), str)]
    ends = [(d, [i for i, ch in enumerate(text) if ch == "\n" and i >= cfg.min_context_chars])
            for d, text in enumerate(docs)]
    ends = [(d, e) for d, e in ends if e]
    if not ends:
        raise DataError(f"{file}: no document has a line end past {cfg.min_context_chars} characters")
    weights = [len(e) for _, e in ends]  # documents in proportion to their lines
    out = []
    for d, e in rng.choices(ends, weights=weights, k=n):
        cut = rng.choice(e)
        text = docs[d][max(0, cut - cfg.context_chars):cut]
        out.append(Prompt(tok.encode(text), "text"))
    return out


def chat_prompts(path: Path, encoder, n: int, rng: random.Random) -> list[Prompt]:
    """The prompt part (everything before the first answer token) of `n` chat / FIM records, drawn without
    replacement while they last."""
    from unmask.train.sft import read_jsonl

    records, _ = read_jsonl(path, "skip")
    prompts = []
    for _, rec in records:
        try:
            ids, mask = encoder.encode(rec)
        except Exception:  # malformed records are the SFT reader's to report; here they are simply not drawn
            continue
        first = next((i for i, m in enumerate(mask) if m), None)
        if first:
            prompts.append(Prompt(ids[:first], "chat"))
    if not prompts:
        raise DataError(f"{path}: no usable chat or FIM record to draw prompts from")
    rng.shuffle(prompts)
    return [prompts[i % len(prompts)] for i in range(n)]


def draw_prompts(cfg: TrajectoryConfig, tok, text: Path | None, chat: Path | None, encoder,
                 max_prompt: int) -> list[Prompt]:
    """The run's prompts in a fixed order (a function of cfg.seed and the files), longest-context ones cut to
    `max_prompt` tokens from the left so prompt + answer fit the training rows."""
    if text is None and chat is None:
        raise DataError("distillation needs prompts: a text corpus, a chat / FIM file, or both")
    rng = random.Random(cfg.seed)
    n_chat = 0 if chat is None else (cfg.prompts if text is None else round(cfg.prompts * cfg.chat_fraction))
    out = text_prompts(text, tok, cfg.prompts - n_chat, cfg, rng) if text is not None and n_chat < cfg.prompts \
        else []
    if n_chat:
        out += chat_prompts(chat, encoder, n_chat, rng)
    rng.shuffle(out)
    for p in out:
        p.ids = p.ids[-max_prompt:]
    return [p for p in out if p.ids]


# ------------------------------------------------------------------ generation and cache

def generate(engine: Engine, prompts: list[Prompt], params: GenerationParams) -> tuple[list[Trajectory], TeacherCost]:
    """Answer every prompt through the engine, batched as the scheduler allows. The stop token that ended an
    answer is kept (the student learns where answers end); the engine's output ids leave it out. Each answer
    token's `order` is the request's forward count when it was committed: the teacher's unmasking order, which
    the commit filter's calibration (`calibrate.py`) replays."""
    t0, fed0 = time.perf_counter(), engine.stats.tokens_fed
    seqs = [engine.add_request(list(p.ids), params) for p in prompts]
    orders = {s.request_id: torch.full((params.max_tokens,), -1, dtype=torch.long) for s in seqs}
    live = list(seqs)
    while engine.has_unfinished():
        engine.step()
        for s in live:
            order = orders[s.request_id][: s.block_end - s.P]
            fresh = (s.seq[s.P:s.block_end] != s.traits.mask_id) & (order < 0)
            order[fresh] = s.stats.forwards
        live = [s for s in live if s.finish_reason is None]
    out = []
    for p, s in zip(prompts, seqs):
        answer = s.output_ids
        if s.finish_reason == "stop" and s.stop_at is not None:
            answer = answer + [int(s.seq[s.stop_at])]
        order = orders[s.request_id][: len(answer)].tolist()
        out.append(Trajectory(list(p.ids), answer, p.kind, s.finish_reason or "length", s.stats.forwards, order))
    cost = TeacherCost(requests=len(out), answer_tokens=sum(len(t.answer) for t in out),
                       forwards=sum(t.forwards for t in out), tokens_fed=engine.stats.tokens_fed - fed0,
                       seconds=time.perf_counter() - t0)
    return out, cost


@dataclass
class TrajectoryCache:
    """out_dir/trajectories: meta.json (identity) and shard-NNNNN.jsonl files (one trajectory a line, then a
    last line with the shard's cost)."""

    root: Path
    identity: dict = field(default_factory=dict)

    def open(self) -> None:
        """Create the cache, or check that an existing one was made by the same teacher and recipe."""
        meta = self.root / META
        if meta.is_file():
            try:
                saved = json.loads(meta.read_text())
            except (OSError, ValueError) as e:
                raise DataError(f"{meta}: unreadable trajectory cache ({e}); remove it to regenerate") from None
            for key in ("format", "teacher_weights", "tokenizer", "recipe", "sources"):
                if saved.get(key) != self.identity.get(key):
                    raise DataError(f"{self.root}: trajectories were made with another {key.replace('_', ' ')} "
                                    f"({_short(saved.get(key))}, now {_short(self.identity.get(key))}); "
                                    "remove the folder or use another --out")
            return
        self.root.mkdir(parents=True, exist_ok=True)
        _atomic_text(meta, json.dumps(self.identity, indent=2))

    def shard_path(self, i: int) -> Path:
        return self.root / f"shard-{i:05d}.jsonl"

    def read(self, i: int) -> tuple[list[Trajectory], TeacherCost] | None:
        path = self.shard_path(i)
        if not path.is_file():
            return None
        lines = path.read_text().splitlines()
        try:
            cost = TeacherCost(**json.loads(lines[-1])["cost"])
            return [Trajectory(**json.loads(line)) for line in lines[:-1]], cost
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise DataError(f"{path}: damaged trajectory shard ({e}); remove it to regenerate") from None

    def write(self, i: int, trajs: list[Trajectory], cost: TeacherCost) -> None:
        body = "".join(json.dumps(asdict(t)) + "\n" for t in trajs) + json.dumps({"cost": asdict(cost)}) + "\n"
        _atomic_text(self.shard_path(i), body)


def generate_missing(cache: TrajectoryCache, prompts: list[Prompt], shard_size: int,
                     engine_factory: Callable[[], Engine], params: GenerationParams, rank: int = 0, world: int = 1,
                     log: Callable[[str], None] = print) -> int:
    """Generate the shards this process owns (shard i belongs to rank i mod world) that the cache lacks; the
    teacher is loaded only if one is missing. Returns how many it generated."""
    engine = None
    n_shards = -(-len(prompts) // shard_size)
    made = 0
    for i in range(rank, n_shards, world):
        if cache.shard_path(i).is_file():
            continue
        engine = engine or engine_factory()
        trajs, cost = generate(engine, prompts[i * shard_size:(i + 1) * shard_size], params)
        cache.write(i, trajs, cost)
        made += 1
        log(f"trajectories: shard {i + 1}/{n_shards}: {cost.requests} answers, "
            f"{cost.answer_tokens / max(cost.forwards, 1):.2f} tokens/forward, "
            f"{cost.answer_tokens / max(cost.seconds, 1e-9):.0f} tokens/s")
    return made


def read_all(cache: TrajectoryCache, prompts: list[Prompt], shard_size: int) -> tuple[list[Trajectory], TeacherCost]:
    """Every shard, checked against this run's prompts (a shard of another prompt draw is refused)."""
    trajs: list[Trajectory] = []
    total = TeacherCost()
    for i in range(-(-len(prompts) // shard_size)):
        chunk = prompts[i * shard_size:(i + 1) * shard_size]
        got = cache.read(i)
        if got is None:
            raise DataError(f"{cache.shard_path(i)} is missing (a process that should have written it failed)")
        if len(got[0]) != len(chunk) or any(t.prompt != p.ids for t, p in zip(got[0], chunk)):
            raise DataError(f"{cache.shard_path(i)}: its prompts are not this run's; remove the folder to regenerate")
        trajs += got[0]
        total.add(got[1])
    return trajs, total


def _short(v) -> str:
    s = json.dumps(v, sort_keys=True) if not isinstance(v, str) else v
    return s if len(s) <= 60 else s[:57] + "..."


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
