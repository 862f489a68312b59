"""Speed vs quality per decoding policy on the held-out tasks, beside the autoregressive twin.

Tasks: `unmask.evaluation` next-line completion (held-out stdlib files) and single-line infill (held-out
FIM records), exact match of the first answer line (`Task.answer`: next-line answers open with the
newline that ends the prompt's line), greedy, max 48 tokens: the model card's evaluation. Every request runs alone (batch 1) through the offline API with the prefix cache off, so
each one pays its own prefill, as the twin's `generate` does.

Interleaving: for each task, every variant runs once, in an order rotated by one per task and per
round; a round is one pass over all tasks. Per round and variant: tokens/s = generated tokens / summed
request seconds, latency = mean seconds per request, tokens per forward; ratios to the one-token-per-
forward baseline are taken within each round. Greedy decoding is deterministic, so accuracy is the
same in every round (checked and recorded).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from .common import interleave, ratio_summary, summary, wilson

MAX_TOKENS = 48


@dataclass
class Variant:
    name: str
    label: str
    engine: dict | None = None       # GenerationParams knobs for unmask
    decoder: object | None = None    # a twin decoder (twin.HFTwin, ...)
    cache: str = "exact"
    group: str = "unmask"            # "unmask", "distilled" (another unmask model, `llm`) or "twin"
    llm: object | None = None        # the LLM this variant decodes with (None: the section's model)
    warmup_tasks: int = 1            # untimed requests first (a compiled step: every task, so each shape compiles)


def unmask_variants(block_size: int, bidirectional: bool, learned: bool = False,
                    speculative: bool = False, ngrams: bool = False) -> list[Variant]:
    """Every policy; with `learned` (the model has a commit filter, `unmask calibrate`) the learned rule too; with
    `speculative` (a causal-context model, engine/speculative.py) self-speculative decoding, its output exactly
    the model's own next-token decoding (`next_token_greedy`, block size 1), with one draft block or one per
    outcome, with draft blocks of 4, and with prompt-lookup drafts beside them; with `ngrams` (the model ships an
    n-gram draft table) the last also without the table."""
    base = [
        ("one_token_per_forward", "one token per forward (AR-equivalent)", dict(policy="topk", tokens_per_step=1)),
        ("low_confidence_2", "low-confidence, 2 tokens/step", dict(policy="low_confidence", steps=max(1, block_size // 2))),
        ("low_confidence_4", "low-confidence, 4 tokens/step", dict(policy="low_confidence", steps=max(1, block_size // 4))),
        ("threshold_0.7", "threshold 0.7", dict(policy="threshold", threshold=0.7)),
        ("threshold_0.8", "threshold 0.8", dict(policy="threshold", threshold=0.8)),
        ("threshold_0.9", "threshold 0.9 (default)", dict(policy="threshold", threshold=0.9)),
        ("threshold_0.95", "threshold 0.95", dict(policy="threshold", threshold=0.95)),
        ("entropy_bounded", "entropy-bounded (0.35 nats)", dict(policy="entropy_bounded")),
        ("credit", "credit decoding (threshold 0.9)", dict(policy="credit", threshold=0.9)),
    ]
    if learned:
        base += [(f"learned_{t}", f"learned commit filter, p(final) >= {t}", dict(policy="learned", threshold=t))
                 for t in (0.9, 0.8)]
    if speculative:
        base += [
            ("next_token_greedy", "next-token rows, one token per forward (block 1)",
             dict(policy="topk", tokens_per_step=1, block_size=1)),
            ("speculative", "self-speculative, one draft block", dict(policy="speculative")),
            ("speculative_all", "self-speculative, a draft block per outcome",
             dict(policy="speculative", draft_all_outcomes=True)),
            ("speculative_b4", "self-speculative, draft blocks of 4", dict(policy="speculative", block_size=4)),
            # the built-in model's default policy (its generation_config.json)
            ("speculative_b4_lookup", "self-speculative, draft blocks of 4 and up to 8 prompt-lookup drafts",
             dict(policy="speculative", block_size=4, draft_lookup=8)),
        ]
        if ngrams:
            base.append(("speculative_b4_lookup_no_ngrams", "the same without the model's n-gram draft table",
                         dict(policy="speculative", block_size=4, draft_lookup=8, draft_ngrams=False)))
    if not bidirectional:  # block-causal: the exact cache is always on, there is no cache switch
        return [Variant(n, lbl, knobs) for n, lbl, knobs in base]
    out = []
    for cache in ("none", "prefix", "dual"):
        out += [Variant(f"{n}@{cache}", f"{lbl}, cache {cache}", {**knobs, "cache": cache}, cache=cache)
                for n, lbl, knobs in base]
    return out


def model_variants(llm, block_size: int, group: str) -> list[Variant]:
    """Every policy of `unmask_variants` on another model of the same tokenizer (a distilled one), named
    `group:policy`, so that both models run interleaved in one section. Its engine, like the section's, has no
    prefix cache."""
    from unmask.engine.engine import Engine

    llm.engine = Engine(llm.model, llm.spec, llm.tokenizer, max_num_seqs=1, max_batch_tokens=4096,
                        prefix_cache_bytes=0)
    learned = llm.engine.traits.commit_filter is not None
    return [Variant(f"{group}:{v.name}", f"{group}: {v.label}", v.engine, group=group, llm=llm)
            for v in unmask_variants(block_size, False, learned, speculative=speculative_model(llm),
                                     ngrams=llm.engine.traits.ngram_drafts is not None)]


def speculative_model(llm) -> bool:
    """Whether the `speculative` policy runs on this model (a block-causal model with a causal context)."""
    t = llm.engine.traits
    return t.attention == "block_causal" and t.shift and t.causal_context and llm.spec.family.sequence_class is None


def load_tasks(llm, corpus: Path, sft_heldout: Path, n_next_line: int, n_infill: int) -> tuple[list, dict]:
    from unmask.evaluation import infill_tasks, next_line_tasks
    from unmask.train.corpus import read_documents
    from unmask.train.instructions import read_jsonl

    docs = list(read_documents(corpus / "heldout.jsonl"))
    tasks = list(next_line_tasks(docs, n_next_line))
    if sft_heldout.is_file() and n_infill:
        tasks += infill_tasks(read_jsonl(sft_heldout), n_infill)
    fit = [t for t in tasks if len(llm.encode(t.prompt)) + MAX_TOKENS <= llm.spec.max_context]
    info = {"next_line": sum(t.kind == "next_line" for t in fit), "infill": sum(t.kind == "infill" for t in fit),
            "dropped_over_context": len(tasks) - len(fit),
            "sources": {"next_line": str(corpus / "heldout.jsonl"), "infill": str(sft_heldout)}}
    return fit, info


@dataclass
class Tally:
    correct: int = 0
    n: int = 0
    tokens: int = 0
    forwards: int = 0
    seconds: float = 0.0
    latencies: list = field(default_factory=list)


def run_section(llm, variants: list[Variant], tasks: list, rounds: int, log) -> dict:
    from unmask.engine.engine import Engine
    from unmask.engine.params import GenerationParams

    # a fresh engine without the prefix cache: repeated prompts must not skip their prefill
    llm.engine = Engine(llm.model, llm.spec, llm.tokenizer, max_num_seqs=1, max_batch_tokens=4096,
                        prefix_cache_bytes=0)
    prompts = [llm.encode(t.prompt) for t in tasks]
    by_name = {v.name: v for v in variants}
    names = [v.name for v in variants]
    kinds = sorted({t.kind for t in tasks})

    def one(v: Variant, i: int) -> tuple[str, int, int, float]:
        t = tasks[i]
        if v.decoder is not None:
            r = v.decoder.run(prompts[i], MAX_TOKENS, stop_newline="\n" in t.stop, min_tokens=t.min_tokens)
            return r.text, r.tokens, r.forwards, r.seconds
        params = GenerationParams(max_tokens=MAX_TOKENS, stop=list(t.stop), min_tokens=t.min_tokens, **v.engine)
        t0 = time.perf_counter()
        out = (v.llm or llm).generate([prompts[i]], [params])[0]
        return out.text, len(out.token_ids), out.forwards, time.perf_counter() - t0

    # warm-up (untimed): one request per variant, or its warmup_tasks
    for v in variants:
        for i in range(min(max(1, v.warmup_tasks), len(tasks))):
            one(v, i)
    tallies = [{n: {k: Tally() for k in kinds} for n in names} for _ in range(rounds)]
    outputs: dict[str, list[str]] = {n: [""] * len(tasks) for n in names}
    t_start = time.perf_counter()
    for r in range(rounds):
        for i, task in enumerate(tasks):
            for n in _rotate(names, i + r):
                text, tokens, forwards, seconds = one(by_name[n], i)
                text = task.answer(text)
                ty = tallies[r][n][task.kind]
                ty.correct += text == task.target
                ty.n += 1
                ty.tokens += tokens
                ty.forwards += forwards
                ty.seconds += seconds
                ty.latencies.append(seconds)
                if r == 0:
                    outputs[n][i] = text
        log(f"  policies: round {r + 1}/{rounds} done ({time.perf_counter() - t_start:.0f} s)")

    results = {}
    base = names[0]
    per_round_tps = {n: [] for n in names}
    for n in names:
        v = by_name[n]
        rounds_stats = []
        for r in range(rounds):
            ts = tallies[r][n].values()
            tok, fwd = sum(t.tokens for t in ts), sum(t.forwards for t in ts)
            sec, req = sum(t.seconds for t in ts), sum(t.n for t in ts)
            rounds_stats.append({"tokens_per_s": tok / sec if sec else None, "latency_ms": 1e3 * sec / max(req, 1),
                                 "tokens_per_forward": tok / max(fwd, 1)})
            per_round_tps[n].append(rounds_stats[-1]["tokens_per_s"])
        acc = {}
        for k in kinds:
            t0 = tallies[0][n][k]
            lo, hi = wilson(t0.correct, t0.n)
            stable = all(tallies[r][n][k].correct == t0.correct for r in range(rounds))
            acc[k] = {"accuracy": t0.correct / max(t0.n, 1), "correct": t0.correct, "n": t0.n, "ci95": [lo, hi],
                      "same_every_round": stable,
                      "tokens_per_forward": t0.tokens / max(t0.forwards, 1),
                      "latency_ms": summary([1e3 * tallies[r][n][k].seconds / max(tallies[r][n][k].n, 1)
                                             for r in range(rounds)])}
        all_c = sum(tallies[0][n][k].correct for k in kinds)
        all_n = sum(tallies[0][n][k].n for k in kinds)
        results[n] = {
            "label": v.label, "group": v.group, "cache": v.cache, "params": v.engine,
            "accuracy": all_c / max(all_n, 1), "correct": all_c, "n": all_n, "ci95": list(wilson(all_c, all_n)),
            "by_task": acc,
            "tokens_per_forward": summary([s["tokens_per_forward"] for s in rounds_stats]),
            "tokens_per_s": summary([s["tokens_per_s"] for s in rounds_stats]),
            "latency_ms": summary([s["latency_ms"] for s in rounds_stats]),
        }
    for n in names:
        results[n]["tokens_per_s_rounds"] = per_round_tps[n]
        results[n]["speed_vs_baseline"] = ratio_summary(per_round_tps[n], per_round_tps[base])
    if "threshold_0.9" in results:
        for n in names:
            results[n]["speed_vs_default"] = ratio_summary(per_round_tps[n], per_round_tps["threshold_0.9"])
    # a few outputs for the record (round 0), to see what the numbers mean
    examples = [{"kind": tasks[i].kind, "target": tasks[i].target,
                 **{n: outputs[n][i] for n in names}} for i in range(min(3, len(tasks)))]
    return {"variants": results, "order": names, "baseline": base, "rounds": rounds,
            "max_tokens": MAX_TOKENS, "examples": examples, "seconds": time.perf_counter() - t_start}


def _rotate(names: list[str], k: int) -> list[str]:
    k %= len(names)
    return names[k:] + names[:k]


__all__ = ["Variant", "unmask_variants", "model_variants", "load_tasks", "run_section", "interleave"]
