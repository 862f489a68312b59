"""The bench's policy section with a second (distilled) model: both decoded interleaved, each with its own
numbers, equal to decoding that model directly."""
from __future__ import annotations

import sys
from pathlib import Path

from test_train import tiny_cfg, tokdir, write_corpus  # noqa: F401 (tokdir: a fixture)
from unmask.engine.llm import LLM
from unmask.engine.params import GenerationParams
from unmask.evaluation import Task
from unmask.train.trainer import train

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from benchlib import policies  # noqa: E402

TEXT = "def add(a, b):\n    return a + b\n\nthe cat sat on the mat.\n"


def test_a_second_model_runs_every_policy_in_the_same_rounds(tmp_path, tokdir):
    (tmp_path / "corpus").mkdir()
    corpus = write_corpus(tmp_path / "corpus", TEXT * 4, n=4)
    a = train(tiny_cfg(tmp_path / "a", total_steps=2, seq_len=64), corpus, tokdir).model_dir
    b = train(tiny_cfg(tmp_path / "b", total_steps=2, seq_len=64, seed=1), corpus, tokdir).model_dir
    base, other = LLM(a, dtype="float32", device="cpu"), LLM(b, dtype="float32", device="cpu")
    tasks = [Task("next_line", "def add(a, b):", "    return a + b", ("\n",), lead="\n"),
             Task("next_line", "the cat sat", " on the mat.", ("\n",))]
    variants = policies.unmask_variants(base.spec.block_size, False)[:2]
    extra = policies.model_variants(other, base.spec.block_size, "distilled")[:2]
    assert [v.name for v in extra] == ["distilled:one_token_per_forward", "distilled:low_confidence_2"]
    sec = policies.run_section(base, variants + extra, tasks, rounds=2, log=lambda _: None)
    assert sec["order"] == [v.name for v in variants + extra]
    assert sec["variants"]["distilled:one_token_per_forward"]["group"] == "distilled"
    # each variant's tokens per forward is that of its own model decoding the tasks directly
    for llm, name in ((base, "one_token_per_forward"), (other, "distilled:one_token_per_forward")):
        outs = [llm.generate([llm.encode(t.prompt)], [GenerationParams(max_tokens=policies.MAX_TOKENS, stop=list(t.stop),
                                                                       min_tokens=t.min_tokens, policy="topk",
                                                                       tokens_per_step=1)])[0] for t in tasks]
        want = sum(len(o.token_ids) for o in outs) / sum(o.forwards for o in outs)
        assert sec["variants"][name]["tokens_per_forward"]["median"] == want


def test_a_model_with_an_ngram_table_is_also_measured_without_it():
    names = lambda **kw: {v.name: v.engine for v in policies.unmask_variants(8, False, speculative=True, **kw)}
    with_table = names(ngrams=True)
    assert with_table["speculative_b4_lookup_no_ngrams"] == dict(policy="speculative", block_size=4, draft_lookup=8,
                                                               draft_ngrams=False)
    assert "speculative_b4_lookup_no_ngrams" not in names() and "speculative_b4_lookup" in names()
