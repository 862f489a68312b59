"""Held-out evaluation of a model: next-line completion and infill exact match, per decoding policy.

Tasks come from the corpus's held-out files (split by file, never seen in training):
  next_line  the file up to the end of the line before a code line -> a newline, then that line (exact match
             of the first line after the newline). The prompt stops before the newline because this
             tokenizer merges a newline with the next line's indentation ("\n   " is one token): a prompt
             ending in a bare "\n" token is a boundary the model never saw in training
  infill     <|fim_prefix|>P<|fim_suffix|>S<|fim_middle|> -> the single-line span between them
  function   the file up to the end of a `def` line -> up to FUNCTION_TOKENS tokens of body: long-form
             generation, where a weak model degenerates into loops that one-line tasks never show
Each task set runs under several policies; reported: exact-match accuracy, edit similarity (the mean
difflib ratio between answer and target, 0..1: CodeXGLUE's line-completion "ES" up to scale, which
separates a near miss from nonsense where exact match is 0 for both), tokens per forward, tokens/s.
Function bodies also report the share of answers that are valid Python so far (`codeop`: complete or
incomplete, not an error) and the repeat rate (share of token 4-grams that repeat an earlier 4-gram of the
same answer: 0 for no repetition, near 1 for a loop; the held-out bodies themselves score `target_repeat`).
Chat endings: the held-out instruction records' conversations up to their last assistant turn, answered
greedily; reported per record kind is the share of answers that end by themselves (a stop token) within
CHAT_TOKENS, the product's "a chat answer ends by itself", their mean length, their edit similarity to the
reference answer, and, where the reference is one JSON value (JSON answers, single tool calls), how many
answers parse as JSON.
"""
from __future__ import annotations

import codeop
import difflib
import hashlib
import json
import textwrap
import time
import warnings
from dataclasses import dataclass

from unmask.engine.llm import LLM
from unmask.engine.params import GenerationParams


@dataclass(frozen=True)
class Task:
    kind: str
    prompt: str
    target: str
    stop: tuple[str, ...]
    lead: str = ""   # text the answer opens with, not scored (next_line: the newline ending the prompt's line)
    header: str = ""  # function: the `def` line the body belongs to (for the syntax check)

    @property
    def min_tokens(self) -> int:
        """The lead's token must not end the answer: the newline stop applies after the first token."""
        return 1 if self.lead else 0

    def answer(self, text: str) -> str:
        """The scored part of a generated text: after the lead, up to the first newline, right-stripped
        (function: every complete line, i.e. up to the last newline)."""
        if self.kind == "function":
            return text.rsplit("\n", 1)[0] if "\n" in text else ""
        if self.lead and text.startswith(self.lead):
            text = text[len(self.lead):]
        return text.split("\n", 1)[0].rstrip()


@dataclass
class PolicyResult:
    task: str
    policy: str
    accuracy: float
    n: int
    tokens: int
    forwards: int
    seconds: float
    edit_similarity: float = 0.0
    valid: float | None = None          # function: share of answers that are valid Python so far
    repeat: float | None = None         # function: mean 4-gram repeat rate of the answers
    target_repeat: float | None = None  # function: the same of the held-out bodies
    prefill_forwards: int = 0           # of `forwards`, prompt-only chunks (not in tokens_per_forward)

    @property
    def tokens_per_forward(self) -> float:
        """Tokens per decoding forward. The tasks run as one batch, whose token budget splits some prompts
        into write-only chunks; those chunks depend on the batch, not on the policy, so they are not counted
        (alone, a prompt within the budget rides in its first decoding forward). `forwards` keeps them."""
        return self.tokens / max(self.forwards - self.prefill_forwards, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


CHAT_TOKENS = 192


@dataclass
class EndingResult:
    kind: str
    n: int = 0
    ended: int = 0         # answers that stopped on a stop token before CHAT_TOKENS
    tokens: int = 0
    similarity: float = 0.0  # summed edit similarity to the reference answers
    json_n: int = 0        # records whose reference answer is one JSON value
    json_valid: int = 0    # ... whose answer parses as JSON too

    @property
    def mean_similarity(self) -> float:
        return self.similarity / max(self.n, 1)

    @property
    def rate(self) -> float:
        return self.ended / max(self.n, 1)

    @property
    def mean_length(self) -> float:
        return self.tokens / max(self.n, 1)


def chat_endings(llm: LLM, records, limit: int = 200, max_tokens: int = CHAT_TOKENS,
                 **overrides) -> list[EndingResult]:
    """Greedy answers to the first `limit` chat records (FIM records skipped), each prompted with its
    conversation up to its last assistant turn; one result per record kind, sorted by kind. `overrides`
    (block size, penalties; None: the default) apply to every answer, under the default policy."""
    prompts, kinds, references = [], [], []
    for rec in records:
        msgs = rec.get("messages")
        last = max((i for i, m in enumerate(msgs or []) if m.get("role") == "assistant"), default=None)
        if last is None:
            continue
        prompts.append(llm.chat_prompt(msgs[:last], tools=rec.get("tools")))
        kinds.append(rec.get("kind", "chat"))
        references.append(_answer_text(msgs[last]))
        if len(prompts) == limit:
            break
    knobs = {k: v for k, v in overrides.items() if v is not None}
    outs = llm.generate(prompts, GenerationParams(max_tokens=max_tokens, **knobs)) if prompts else []
    by_kind: dict[str, EndingResult] = {}
    for kind, out, ref in zip(kinds, outs, references):
        r = by_kind.setdefault(kind, EndingResult(kind))
        r.n += 1
        r.ended += out.finish_reason == "stop"
        r.tokens += len(out.token_ids)
        r.similarity += edit_similarity(out.text.strip(), ref)
        if _parses_as_json(ref):
            r.json_n += 1
            r.json_valid += _parses_as_json(out.text)
    return [by_kind[k] for k in sorted(by_kind)]


def _answer_text(message: dict) -> str:
    """An assistant message as the answer text reads once special tokens are dropped: its content, then each
    tool call as the chat template writes it between <tool_call> tags, one per line."""
    parts = [message.get("content") or ""]
    for call in message.get("tool_calls") or []:
        fn = call.get("function", call)
        args = fn.get("arguments")
        parts.append(f'{{"name": {json.dumps(fn.get("name"))}, "arguments": '
                     f'{args if isinstance(args, str) else json.dumps(args)}}}')
    return "\n".join(p for p in parts if p)


def _parses_as_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _chosen(key: str, rate: float) -> bool:
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < rate


def next_line_tasks(docs, limit: int = 200, context_chars: int = 1200, rate: float = 0.05) -> list[Task]:
    """Code lines of held-out stdlib files, sampled deterministically by a hash of (file, line): each eligible
    line is taken when its hash falls under `rate` (so a higher rate's set holds every lower rate's)."""
    tasks = []
    for doc, lines, i, start in _stdlib_lines(docs):
        line = lines[i]
        body = line.strip()
        if i < 5 or not 8 <= len(body) <= 80 or body.startswith("#") or body.startswith(('"""', "'''")):
            continue
        if _chosen(f"{doc.relpath}:{i}", rate):
            prompt = doc.text[max(0, start - 1 - context_chars):start - 1]  # without the newline
            tasks.append(Task("next_line", prompt, line.rstrip(), ("\n",), lead="\n"))
    return tasks[:limit]


def _stdlib_lines(docs):
    """(document, its lines, line index, offset of the line's first character) over held-out stdlib files."""
    for doc in docs:
        if doc.source != "stdlib":
            continue
        lines = doc.text.split("\n")
        offset = 0
        for i, line in enumerate(lines):
            yield doc, lines, i, offset
            offset += len(line) + 1


def infill_tasks(records, limit: int = 200) -> list[Task]:
    """Single-line spans from the held-out FIM records (`build_instructions(heldout files)`)."""
    tasks = []
    for r in records:
        if r.get("kind") == "fim" and r.get("span") == "line":
            f = r["fim"]
            prompt = f"<|fim_prefix|>{f['prefix']}<|fim_suffix|>{f['suffix']}<|fim_middle|>"
            tasks.append(Task("infill", prompt, f["middle"].rstrip(), ("\n",)))
    return tasks[:limit]


FUNCTION_TOKENS = 64


def function_tasks(docs, limit: int = 200, context_chars: int = 1200, body_lines: int = 12) -> list[Task]:
    """`def` lines of held-out stdlib files whose body follows on the next line, sampled by a hash of
    (file, line); the target is the body's first `body_lines` lines (a stand-in for what 64 tokens cover)."""
    tasks = []
    for doc, lines, i, start in _stdlib_lines(docs):
        line = lines[i]
        head = line.lstrip()
        if not (head.startswith("def ") and line.rstrip().endswith(":")):
            continue
        indent = len(line) - len(head)
        body = []
        for nxt in lines[i + 1:]:
            if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                break
            body.append(nxt)
        if not body or not body[0].strip() or not _chosen(f"{doc.relpath}:{i}:def", 0.5):
            continue
        end = start + len(line)
        prompt = doc.text[max(0, end - context_chars):end]
        target = "\n".join(body[:body_lines]).rstrip()
        tasks.append(Task("function", prompt, "\n" + target, (), header=line.rstrip()))
    return tasks[:limit]


def python_so_far(header: str, body: str) -> bool:
    """Is `header` + `body` valid Python that may still be incomplete? (`codeop`'s verdict, as an
    interactive interpreter uses it: a complete or an incomplete program, not a syntax error)."""
    text = textwrap.dedent(header + body)  # a method's indentation goes with its header
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in generated strings warn
            codeop.compile_command(text + "\n", symbol="exec")
        return True
    except (SyntaxError, ValueError, OverflowError):
        return False


def repeat_rate(ids: list[int], n: int = 4) -> float:
    """Share of the n-grams of `ids` that occurred earlier in `ids` (0.0 when there are none)."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    if not grams:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams)


POLICIES = {
    "one_token_per_forward": dict(policy="topk", tokens_per_step=1),
    "threshold_0.9": dict(policy="threshold", threshold=0.9),
    "threshold_0.7": dict(policy="threshold", threshold=0.7),
    "learned_0.9": dict(policy="learned", threshold=0.9),   # models with a commit filter (`unmask calibrate`)
    "learned_0.8": dict(policy="learned", threshold=0.8),
    # causal-context models (the built-in family): the next-token rows alone, and drafts they verify
    "next_token_greedy": dict(policy="topk", tokens_per_step=1, block_size=1),
    "speculative": dict(policy="speculative"),
    "speculative_all": dict(policy="speculative", draft_all_outcomes=True),
    "speculative_b4": dict(policy="speculative", block_size=4),
    "speculative_b4_lookup": dict(policy="speculative", block_size=4, draft_lookup=8),
    "speculative_b4_lookup_all": dict(policy="speculative", block_size=4, draft_lookup=8, draft_all_outcomes=True),
    # the same without the model's n-gram draft table (decoding.ngram_drafts): what the table adds
    "speculative_b4_lookup_no_ngrams": dict(policy="speculative", block_size=4, draft_lookup=8, draft_ngrams=False),
    # draft blocks of 8: a ~14-token line caps blocks of 4 near 2.7 tokens per forward (one token from the prompt's
    # forward, then at most 4 a step); issue 29's 3 on next lines needs wider drafts
    "speculative_b8_lookup": dict(policy="speculative", block_size=8, draft_lookup=8),
    "speculative_b8_lookup_all": dict(policy="speculative", block_size=8, draft_lookup=8, draft_all_outcomes=True),
}


def evaluate(llm: LLM, tasks: list[Task], policy: str, max_tokens: int | None = None, **overrides) -> PolicyResult:
    """Run `tasks` (one kind) under `policy`; max_tokens defaults to 48 (line tasks) or FUNCTION_TOKENS."""
    knobs = {**POLICIES[policy], **{k: v for k, v in overrides.items() if v is not None}}
    function = bool(tasks) and tasks[0].kind == "function"
    max_tokens = max_tokens or (FUNCTION_TOKENS if function else 48)
    prompts = [llm.encode(t.prompt) for t in tasks]
    params = [GenerationParams(max_tokens=max_tokens, stop=list(t.stop), min_tokens=t.min_tokens, **knobs)
              for t in tasks]
    cache = getattr(getattr(llm, "engine", None), "prefix_cache", None)
    if cache is not None:  # every policy pays its own prefills: prompts cached by the one before would flatter it
        cache.clear()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    answers = [t.answer(o.text) for o, t in zip(outs, tasks)]
    correct = sum(a == t.target for a, t in zip(answers, tasks))
    similarity = sum(edit_similarity(a, t.target) for a, t in zip(answers, tasks))
    n = max(len(tasks), 1)
    extra = {}
    if function:
        extra = dict(valid=sum(python_so_far(t.header, a) for a, t in zip(answers, tasks)) / n,
                     repeat=sum(repeat_rate(o.token_ids) for o in outs) / n,
                     target_repeat=sum(repeat_rate(llm.encode(t.target)[:max_tokens]) for t in tasks) / n)
    return PolicyResult(task=tasks[0].kind if tasks else "", policy=policy, accuracy=correct / n,
                        n=len(tasks), tokens=sum(len(o.token_ids) for o in outs),
                        forwards=sum(o.forwards for o in outs), seconds=seconds,
                        prefill_forwards=sum(o.prefill_forwards for o in outs),
                        edit_similarity=similarity / n, **extra)


def edit_similarity(answer: str, target: str) -> float:
    """difflib's ratio of matching characters, 2 * matches / (len(a) + len(b)); 1.0 for two empty strings."""
    return difflib.SequenceMatcher(None, answer, target, autojunk=False).ratio()


def masked_token_loss(llm: LLM, docs, block_size: int, seq_len: int = 512, max_rows: int = 32, seed: int = 0) -> float:
    """Held-out block-diffusion loss: sum of CE/p over masked tokens / number of tokens, the
    trainer's normalisation (an unbiased bound on the negative log-likelihood per token, in nats)."""
    import torch

    from unmask.train.data import pack_documents
    from unmask.train.objectives import Objective, diffusion_loss_sum, draw_noise

    sep = llm.tokenizer.token_id("<|endoftext|>")
    sep = sep if sep is not None else llm.spec.eos_id
    rows = pack_documents((llm.tokenizer.encode(d.text) for d in docs), seq_len, sep).ids[:max_rows].long()
    obj = Objective(mask_id=llm.spec.mask_id, block_sizes=(block_size,), shift=llm.spec.shift,
                    causal_context=llm.spec.causal_context)  # the mask the model was trained and decodes with
    gen = torch.Generator().manual_seed(seed)
    device = next(llm.model.parameters()).device  # the noise is drawn on the CPU (the trainer's rule), the rows go there
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, rows.shape[0], 8):
            x0 = rows[i:i + 8]
            noise = draw_noise(obj, torch.ones_like(x0, dtype=torch.bool), gen)
            total += float(diffusion_loss_sum(llm.model, x0.to(device), noise, obj))
            count += x0.numel()
    return total / max(count, 1)


def next_token_loss(llm: LLM, docs, seq_len: int = 512, max_rows: int = 64) -> float | None:
    """Held-out next-token cross-entropy under causal attention (nats per token), for shifted-logit models
    on the shared transformer (`forward_dense`): how much of an AR-initialised model's left-to-right
    ability remains, which block-by-block decoding leans on. None for other models."""
    import torch
    import torch.nn.functional as F

    from unmask.models.transformer import CAUSAL
    from unmask.train.data import pack_documents

    if not llm.spec.shift or not hasattr(llm.model, "forward_dense"):
        return None
    sep = llm.tokenizer.token_id("<|endoftext|>")
    sep = sep if sep is not None else llm.spec.eos_id
    rows = pack_documents((llm.tokenizer.encode(d.text) for d in docs), seq_len, sep).ids[:max_rows].long()
    device = next(llm.model.parameters()).device
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, rows.shape[0], 8):
            x = rows[i:i + 8].to(device)
            hidden = llm.model.forward_dense(x, torch.arange(x.shape[1], device=device).expand_as(x), CAUSAL)
            logits = llm.model.logits(hidden[:, :-1])
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                           reduction="sum"))
            count += x[:, 1:].numel()
    return total / max(count, 1)

