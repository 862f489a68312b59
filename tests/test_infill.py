"""Infilling (FIM) and the edit endpoints: span placement, length choice, edit by remasking, the wire.

Tiny random checkpoints write garbage, so nothing here asserts on meaning. What is checked: where the
span sits and that the prefix and suffix never change (against a dense reference loop), the length
rule and that probing costs no extra forward, the FIM-token prompt layout, the deterministic merge of
lazy snippets, that edits leave every line outside the rewritten regions byte-identical, the
streaming shape and the errors. Server tests run real `unmask serve` processes on loopback ports.
"""
from __future__ import annotations

import json
import string
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from unmask.decoding import BlockState, decide
from unmask.edits import choice_infill, parse_apply_prompt, parse_next_edit_prompt, plan_merge, plan_next_edit
from unmask.edits.apply import is_marker
from unmask.edits.next_edit import removed_names
from unmask.edits.plan import Choice, Fixed, Rewrite, section
from unmask.engine.engine import Engine
from unmask.engine.infill import (FIM_TOKENS, InfillPrompt, InfillSequence, ProbeStat, build_infill, candidate_lengths,
                                  choose_length, infill_mode, infill_params)
from unmask.engine.params import GenerationParams
from unmask.errors import ContextLengthError, InvalidRequestError
from unmask.models.loader import load_model
from unmask.tokenizer import Tokenizer

from test_server import Server


# ---------------------------------------------------------------------------------------- checkpoints
def make_unmask_checkpoint(out: Path) -> Path:
    """A tiny model of the built-in family (block-causal, FIM tokens 6/7/8, EOS 2) whose output head only
    proposes letters, digits and spaces, so answers are random printable text."""
    from unmask.train.checkpoint import export_model
    from unmask.train.model_init import fresh_model, new_unmask_config
    from unmask.train.tokenizer import save_hf_tokenizer, train_tokenizer

    texts = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n", "x = y + 1\n"] * 20
    tok_dir = out.with_name(out.name + "-tok")
    save_hf_tokenizer(train_tokenizer(texts, vocab_size=320, min_frequency=1), tok_dir)
    n = len(Tokenizer(tok_dir).hf)
    cfg = new_unmask_config(n, 32, 2, 4, 2, 8, 64, 512, 4, mask_id=3, eos_ids=[2])
    path = export_model(fresh_model(cfg, {"eos_token_id": [2, 5]}, seed=0), out, tok_dir)
    tensors = load_file(path / "model.safetensors")
    tok = Tokenizer(path)
    allowed = set(string.ascii_letters + string.digits + " ")
    keep = [i for i in range(n) if (s := tok.decode([i])) and set(s) <= allowed]
    head = torch.zeros_like(tensors["lm_head.weight"])
    head[keep] = tensors["lm_head.weight"][keep] * 100.0
    tensors["lm_head.weight"] = head
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def unmask_dir(tmp_path_factory) -> Path:
    return make_unmask_checkpoint(tmp_path_factory.mktemp("unmask") / "tiny-unmask")


@pytest.fixture(scope="module")
def bidir(family_dirs):
    return {f: load_model(family_dirs[f]) for f in ("llada", "dream")}


# ---------------------------------------------------------------------------------------- length rule
def test_candidate_lengths():
    assert candidate_lengths(256) == [2, 4, 8, 16, 32, 64, 128, 256]
    assert candidate_lengths(5) == [2, 4, 5]
    assert candidate_lengths(1) == [1]
    assert candidate_lengths(1000) == [4, 8, 16, 32, 64, 128, 256, 512, 1000][-8:]


def test_choose_length_rule():
    s = [ProbeStat(4, 0.1, -2.0), ProbeStat(8, 0.7, -3.0), ProbeStat(16, 0.9, -1.0), ProbeStat(32, 0.2, -0.5)]
    assert choose_length(s) == 8                         # the shortest span the model gives room
    assert choose_length(s, threshold=0.95) == 32        # nobody has room: the best score
    tie = [ProbeStat(4, 0.0, -1.0), ProbeStat(8, 0.0, -1.0)]
    assert choose_length(tie) == 8                       # ties: the longer
    # the rule can run as candidates arrive: the final winner won when it arrived
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]):
        seen = []
        winners = set()
        for k in order:
            seen.append(s[k])
            winners.add(choose_length(seen))
        assert choose_length(s) in winners


# ---------------------------------------------------------------------------------------- masked span
def naive_span(model, spec, prompt, suffix, n, params):
    """Dense reference: canvas [prompt | n masks | suffix], the whole canvas every step, LLaDA blocks."""
    B, mask, P = params.block_size or spec.block_size, spec.mask_id, len(prompt)
    end = P + n
    seq = torch.tensor(prompt + [mask] * n + suffix)
    gen = torch.Generator().manual_seed(params.seed or 0)
    start, stops = P, set(spec.stop_ids)
    while True:
        stop_blk = min(start + B, end)
        state = BlockState(initial_masked=int((seq[start:stop_blk] == mask).sum()))
        while (seq[start:stop_blk] == mask).any():
            with torch.inference_mode():
                logits = model.logits(model.forward_dense(seq[None], torch.arange(len(seq))[None], None))[0]
            targets = (seq[start:stop_blk] == mask).nonzero(as_tuple=True)[0] + start
            lg = logits[targets - int(spec.shift)].clone()
            lg[:, mask] = float("-inf")
            d = decide(params.policy_config(), lg, targets - start, state, params.sampling(), gen)
            seq[targets[d.commit]] = d.tokens[d.commit]
        out = seq[P:stop_blk].tolist()
        for i, t in enumerate(out):
            if t in stops:
                return out[:i], seq
        if stop_blk >= end:
            return out, seq
        start = stop_blk


PROMPT, SUFFIX = list(range(20, 29)), list(range(60, 66))


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_masked_span_matches_dense_reference_and_keeps_both_sides(family, bidir):
    model, spec = bidir[family]
    params = GenerationParams(max_tokens=10, block_size=4, threshold=0.3, seed=0, suffix_ids=SUFFIX,
                              infill_lengths=[7])
    eng = Engine(model, spec)
    seq = eng.add_request(PROMPT, params)
    eng.run_to_completion()
    want, ref_canvas = naive_span(model, spec, PROMPT, SUFFIX, 7, params)
    assert isinstance(seq, InfillSequence) and seq.span_length == 7 and seq.probe_stats == []
    assert seq.output_ids == want
    assert seq.seq[:len(PROMPT)].tolist() == PROMPT                       # prefix untouched
    assert seq.seq[seq.end:].tolist() == SUFFIX and seq.end == len(PROMPT) + 7  # suffix right after the span
    if len(want) == 7:
        assert torch.equal(seq.seq, ref_canvas)


def test_suffix_is_seen(bidir):
    """The suffix is attended to: the same prefix with another suffix gets other logits in the span."""
    model, spec = bidir["llada"]
    outs = []
    for suffix in (SUFFIX, list(range(90, 96))):
        eng = Engine(model, spec)
        seq = eng.add_request(PROMPT, GenerationParams(max_tokens=6, block_size=6, seed=0, suffix_ids=suffix,
                                                       infill_lengths=[3, 6]))
        eng.step()
        outs.append([s.score for s in seq.probe_stats])
    assert outs[0] != outs[1]


def probe_reference(model, spec, prompt, suffix, n, B):
    ids = torch.tensor(prompt + [spec.mask_id] * n + suffix)
    with torch.inference_mode():
        logits = model.logits(model.forward_dense(ids[None], torch.arange(len(ids))[None], None))[0]
    first = min(B, n)
    offs = list(range(first)) + list(range(max(first, n - B), n))
    lg = logits[[len(prompt) + o - int(spec.shift) for o in offs]].clone()
    lg[:, spec.mask_id] = float("-inf")
    logp = lg.log_softmax(-1)
    return float(logp[-1, sorted(spec.stop_ids)].exp().sum()), float(logp.max(-1).values.mean())


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_length_probe_is_one_forward_and_exact(family, bidir):
    model, spec = bidir[family]
    lengths = [2, 4, 8, 12]
    params = GenerationParams(max_tokens=12, block_size=4, threshold=0.3, seed=0, suffix_ids=SUFFIX,
                              infill_lengths=lengths)
    eng = Engine(model, spec)
    seq = eng.add_request(PROMPT, params)
    eng.step()
    # one forward held one canvas per candidate
    assert eng.stats.steps == 1 and seq.stats.forwards == 1
    assert eng.stats.tokens_fed == sum(len(PROMPT) + n + len(SUFFIX) for n in lengths)
    assert [s.length for s in seq.probe_stats] == lengths
    for s in seq.probe_stats:
        end_prob, score = probe_reference(model, spec, PROMPT, SUFFIX, s.length, 4)
        assert s.end_prob == pytest.approx(end_prob, abs=1e-5) and s.score == pytest.approx(score, abs=1e-4)
    chosen = choose_length(seq.probe_stats)
    assert seq.span_length == chosen and seq.end == len(PROMPT) + chosen
    assert seq.seq[seq.end:].tolist() == SUFFIX
    eng.run_to_completion()
    # the probe forward doubled as the winner's first step: same tokens, same forwards as a fixed span
    eng2 = Engine(model, spec)
    fixed = eng2.add_request(PROMPT, GenerationParams(max_tokens=12, block_size=4, threshold=0.3, seed=0,
                                                      suffix_ids=SUFFIX, infill_lengths=[chosen]))
    eng2.run_to_completion()
    assert seq.output_ids == fixed.output_ids
    assert seq.stats.forwards == fixed.stats.forwards
    assert seq.finish_reason == fixed.finish_reason


def test_length_probe_without_suffix_decodes_exactly(bidir):
    """Probing also sizes a plain completion's canvas; a cache mode asked for is replaced by exact decoding
    (the probe forward, which is the first step, wrote no cache)."""
    model, spec = bidir["llada"]
    eng = Engine(model, spec)
    seq = eng.add_request(PROMPT, GenerationParams(max_tokens=8, block_size=4, seed=0, cache="prefix",
                                                   infill_lengths=[4, 8]))
    eng.run_to_completion()
    assert seq.cache_mode == "none" and seq.cache is None
    eng2 = Engine(model, spec)
    fixed = eng2.add_request(PROMPT, GenerationParams(max_tokens=seq.span_length, block_size=4, seed=0))
    eng2.run_to_completion()
    assert seq.output_ids == fixed.output_ids


def test_end_signal_picks_the_shortest_span(bidir):
    """When the model puts an end token at the span's last position, the shortest such span wins and
    the middle ends at the end token (here every token counts as an end token)."""
    model, spec = bidir["llada"]
    vocab = spec.arch.vocab_size
    eng = Engine(model, spec)
    seq = eng.add_request(PROMPT, GenerationParams(max_tokens=16, block_size=4, suffix_ids=SUFFIX,
                                                   infill_lengths=[4, 8, 16], stop_token_ids=list(range(vocab))))
    eng.run_to_completion()
    assert seq.span_length == 4 and seq.output_ids == [] and seq.finish_reason == "stop"


def test_length_probe_reads_logit_bias_and_min_tokens(bidir):
    """The probe scores the distribution the request decodes from: a -100 bias on the end tokens, or
    min_tokens past a candidate's last position, leaves that candidate no room signal."""
    model, spec = bidir["llada"]
    vocab = spec.arch.vocab_size
    half = list(range(vocab // 2))

    def probe(**kw):
        eng = Engine(model, spec)
        seq = eng.add_request(PROMPT, GenerationParams(max_tokens=16, block_size=4, suffix_ids=SUFFIX,
                                                       infill_lengths=[4, 8, 16], **kw))
        eng.step()
        return [s.end_prob for s in seq.probe_stats]

    ends = sorted(set(half) | set(spec.stop_ids))  # the model's own EOS ends a span too
    assert all(0.05 < p < 0.95 for p in probe(stop_token_ids=half))
    assert all(p < 1e-6 for p in probe(stop_token_ids=half, logit_bias={t: -100.0 for t in ends}))
    everything = list(range(vocab))
    assert [p > 0.99 for p in probe(stop_token_ids=everything, min_tokens=4)] == [False, True, True]
    # a candidate shorter than min_tokens cannot hold them: it is not probed at all
    assert [p > 0.99 for p in probe(stop_token_ids=everything, min_tokens=5)] == [True, True]
    eng = Engine(model, spec)
    seq = eng.add_request(PROMPT, GenerationParams(max_tokens=16, block_size=4, suffix_ids=SUFFIX, min_tokens=16,
                                                   infill_lengths=[4, 8, 16]))
    eng.run_to_completion()
    assert seq.lengths == [16] and len(seq.output_ids) == 16
    assert infill_params(InfillPrompt("masked_span", PROMPT, SUFFIX, (0, 0)),
                         GenerationParams(max_tokens=16, min_tokens=5)).infill_lengths == [8, 16]


def test_filled_span_shorter_than_max_tokens_is_a_stop(bidir):
    model, spec = bidir["llada"]
    eng = Engine(model, spec)
    seq = eng.add_request(PROMPT, GenerationParams(max_tokens=8, block_size=4, ignore_eos=True,
                                                   suffix_ids=SUFFIX, infill_lengths=[3]))
    eng.run_to_completion()
    assert seq.num_generated == 3 and seq.finish_reason == "stop"
    eng = Engine(model, spec)
    seq = eng.add_request(PROMPT, GenerationParams(max_tokens=3, block_size=4, ignore_eos=True, suffix_ids=SUFFIX))
    eng.run_to_completion()
    assert seq.num_generated == 3 and seq.finish_reason == "length"


def test_infill_requests_are_checked(bidir, family_dirs):
    model, spec = bidir["llada"]
    eng = Engine(model, spec)
    ctx = spec.max_context
    with pytest.raises(ContextLengthError, match="suffix"):
        eng.check_request([1] * 10, GenerationParams(max_tokens=ctx - 20, suffix_ids=[1] * 20))
    with pytest.raises(InvalidRequestError) as e:
        eng.check_request([1], GenerationParams(max_tokens=4, suffix_ids=[spec.arch.vocab_size]))
    assert e.value.param == "suffix"
    with pytest.raises(InvalidRequestError):
        GenerationParams(max_tokens=4, infill_lengths=[5])
    sdar, sspec = load_model(family_dirs["sdar"])
    with pytest.raises(InvalidRequestError) as e:
        Engine(sdar, sspec).check_request([1], GenerationParams(max_tokens=4, suffix_ids=[1]))
    assert e.value.param == "suffix"


# ---------------------------------------------------------------------------------------- FIM tokens
def test_fim_modes_and_missing_tokens(family_dirs, unmask_dir, bidir):
    _, sdar = load_model(family_dirs["sdar"], dtype="float32")
    with pytest.raises(InvalidRequestError) as e:
        infill_mode(sdar, Tokenizer(family_dirs["sdar"]))
    assert e.value.param == "suffix" and all(t in str(e.value) for t in FIM_TOKENS)
    assert infill_mode(bidir["llada"][1], Tokenizer(family_dirs["llada"])) == "masked_span"
    _, uspec = load_model(unmask_dir)
    tok = Tokenizer(unmask_dir)
    assert infill_mode(uspec, tok) == "fim_tokens"
    ip = build_infill(tok, uspec, "def add(a, b):\n    return ", "\n\nprint(1)\n", 400)
    pre, suf = tok.encode("def add(a, b):\n    return "), tok.encode("\n\nprint(1)\n")
    assert ip.prompt_ids == [6, *pre, 7, *suf, 8] and ip.suffix_ids == []   # PSM, as unmask.train.sft writes it
    assert infill_params(ip, GenerationParams(max_tokens=8)) == GenerationParams(max_tokens=8)
    small = build_infill(tok, uspec, "a = 1\n" * 60, "b = 2\n" * 60, 40)  # trimmed, nearest tokens kept
    ids, pre_all, suf_all = small.prompt_ids, tok.encode("a = 1\n" * 60), tok.encode("b = 2\n" * 60)
    assert len(ids) == 40 and ids[0] == 6 and ids[-1] == 8 and small.dropped[0] > 0 and small.dropped[1] > 0
    k = ids.index(7)
    assert ids[1:k] == pre_all[-(k - 1):] and ids[k + 1:-1] == suf_all[:len(ids) - k - 2]
    # a file that mentions the control tokens keeps them as text: none of its ids is a special token
    code = build_infill(tok, uspec, 'EOS = "<|endoftext|>"\nMID = "<|fim_middle|>"\n', 'x = "<|fim_suffix|>"', 400)
    inner = code.prompt_ids[1:-1]
    assert inner.count(7) == 1 and not {2, 5, 6, 8, 13} & set(inner)
    assert tok.decode(inner[:inner.index(7)]) == 'EOS = "<|endoftext|>"\nMID = "<|fim_middle|>"\n'
    assert tok.encode("<|endoftext|>") == [13] and 13 not in tok.encode("<|endoftext|>", parse_special=False)


def test_masked_span_prompt_needs_a_first_token(family_dirs, bidir):
    _, spec = bidir["dream"]
    tok = Tokenizer(family_dirs["dream"])
    with pytest.raises(InvalidRequestError):
        build_infill(tok, spec, "", "x", 100)     # Dream has no BOS
    _, lspec = bidir["llada"]
    ltok = Tokenizer(family_dirs["llada"])
    ip = build_infill(ltok, lspec, "", "x", 100)
    assert ip.prompt_ids == [ltok.hf.bos_token_id] and ip.suffix_ids == ltok.encode("x")


def test_fim_generation_ends_at_a_stop_token(unmask_dir):
    from unmask.engine.infill import infill
    from unmask.engine.llm import LLM

    llm = LLM(unmask_dir)
    assert 2 in llm.spec.stop_ids                      # <|eos|> ends the middle, as the model is trained
    every = list(range(llm.spec.arch.vocab_size))
    out = infill(llm, "x = ", "\n", GenerationParams(max_tokens=16, stop_token_ids=every))
    assert out.text == "" and out.token_ids == [] and out.finish_reason == "stop" and out.forwards == 1
    out = infill(llm, "x = ", "\n", GenerationParams(max_tokens=6))
    assert out.finish_reason == "length" and len(out.token_ids) == 6 and out.text


# ---------------------------------------------------------------------------------------- apply-edit
ORIGINAL = "import os\n\ndef f(x):\n    y = x + 1\n    return y\n\ndef g():\n    pass\n"


def test_markers():
    for line in ["// ... existing code ...", "# ...", "    /* ... */", "<!-- ... existing code ... -->",
                 "// rest of the code unchanged", "# existing code", "  // ...existing code..."]:
        assert is_marker(line), line
    for line in ["...", "    ...", "print(...)", "x = ...", "# a comment", "return x  # ... later"]:
        assert not is_marker(line), line


@pytest.mark.parametrize("snippet, want", [
    # a modified line between anchors; markers keep the rest
    ("# ... existing code ...\ndef f(x):\n    y = x + 2\n    return y\n# ... existing code ...\n",
     ORIGINAL.replace("x + 1", "x + 2")),
    # anchors adjacent in the snippet: the lines between them are deleted
    ("# ...\ndef f(x):\n    return y\n# ...\n", ORIGINAL.replace("    y = x + 1\n", "")),
    # a new line before the first anchor goes right before it; the head is kept
    ("import sys\nimport os\n# ...\n", "import sys\n" + ORIGINAL),
    # new lines after an anchor, then a marker: inserted right after the anchor
    ("# ...\ndef g():\n    print('g')\n# ...\n", ORIGINAL.replace("def g():\n", "def g():\n    print('g')\n")),
    # no marker at all: the snippet is the whole new code
    ("print('hi')\n", "print('hi')\n"),
])
def test_apply_deterministic_merges(snippet, want):
    plan = plan_merge(ORIGINAL, snippet)
    assert plan.open_pieces() == []
    assert plan.render() == want


def test_apply_reindents_by_anchor_offset():
    original = "class A:\n    def f(self):\n        return 1\n\n    def g(self):\n        return 2\n"
    snippet = "# ...\ndef f(self):\n    x = 5\n    return x\n# ...\n"   # written without the class indentation
    plan = plan_merge(original, snippet)
    (i,) = plan.open_pieces()   # `return x` resembles `return 1`: modify it, or insert before it
    tail = "\n    def g(self):\n        return 2\n"
    assert plan.pieces[i].options == ("        x = 5\n        return x\n        return 1\n" + tail,
                                      "        x = 5\n        return x\n" + tail)
    assert plan.render({i: plan.pieces[i].options[1]}) == original.replace("        return 1\n",
                                                                           "        x = 5\n        return x\n")


def test_apply_final_newline_follows_the_original():
    assert plan_merge("a = 1\nb = 2", "# ...\nb = 3").render() in ("a = 1\nb = 3", "a = 1\nb = 2\nb = 3")
    plan = plan_merge("a = 1\nb = 2", "# ...\nb = 3")
    assert all(not o.endswith("\n") for p in plan.pieces if isinstance(p, Choice) for o in p.options)


MERCURY_ORIGINAL = ('class Calculator:\n    """A simple calculator class."""\n    def __init__(self):\n'
                    '        self.history = []\n\n    def add(self, a, b):\n        """Adds two numbers."""\n'
                    '        result = a + b\n        return result\n')
MERCURY_SNIPPET = ('// ... existing code ...\ndef multiply(self, a, b):\n    """Multiplies two numbers."""\n'
                   '    result = a * b\n    return result\n// ... existing code ...')


def test_apply_ambiguous_placement_is_a_choice_over_full_merges():
    plan = plan_merge(MERCURY_ORIGINAL, MERCURY_SNIPPET)
    (i,) = plan.open_pieces()
    piece = plan.pieces[i]
    assert isinstance(piece, Choice) and 2 <= len(piece.options) <= 32
    method = '    def multiply(self, a, b):\n        """Multiplies two numbers."""\n        result = a * b\n'
    assert MERCURY_ORIGINAL + "\n" + method + "        return result\n" in piece.options   # the reference answer
    assert plan.render() == MERCURY_ORIGINAL + method + "        return result\n"          # default: end, sibling
    orig_lines = MERCURY_ORIGINAL.splitlines()
    for opt in piece.options:  # every option keeps every original line, in order
        it = iter(opt.splitlines())
        assert all(any(line == o for o in it) for line in orig_lines)


def test_apply_offers_to_modify_the_last_line_a_snippet_changes():
    """A snippet that shows only a function's changed last line (after a marker) may modify that line, not
    only add a second one beside it."""
    original = "def f():\n    x = 1\n    y = 2\n    return x + y\n"
    plan = plan_merge(original, "def f():\n    # ... existing code ...\n    return x * y\n")
    (i,) = plan.open_pieces()
    merges = {plan.render({i: o}) for o in plan.pieces[i].options}
    assert original.replace("x + y", "x * y") in merges
    assert plan.render() == original + "    return x * y\n"   # the default stays the literal insertion


def test_apply_unshown_tail_is_a_choice():
    plan = plan_merge(ORIGINAL, "import sys\nimport os\n# ...\ndef g():\n    return 1\n")
    (i,) = plan.open_pieces()
    assert plan.pieces[i].options == ("    return 1\n    pass\n", "    return 1\n")
    assert plan.render().startswith("import sys\nimport os\n\ndef f(x):")


def test_choice_infill_factors_out_shared_lines_and_maps_back():
    opts = ("a\nX\nb\nc\n", "a\nb\nX\nc\n", "a\nb\nc\n")
    ci = choice_infill("head\n", "tail\n", opts)
    assert ci.before == "head\na\n" and ci.middles == ("X\nb\n", "b\nX\n", "b\n") and ci.after == "c\ntail\n"
    assert [ci.option_for(m) for m in ci.middles] == [0, 1, 2]
    ci = choice_infill("h\n", "t\n", ("x\n", ""))      # an empty option borrows the next line
    assert ci.middles == ("x\nt\n", "t\n") and ci.after == ""
    assert choice_infill("", "", ("x\n", "")) is None


def test_parse_apply_prompt():
    msg = f"<|original_code|>\n{ORIGINAL}\n<|/original_code|>\n\n<|update_snippet|>\n# ...\n<|/update_snippet|>"
    assert parse_apply_prompt(msg) == (ORIGINAL, "# ...")
    with pytest.raises(InvalidRequestError, match="update_snippet"):
        parse_apply_prompt("<|original_code|>\nx\n<|/original_code|>")
    assert section("<|a|>\nbody\n<|/a|>", "a") == "body" and section("<|a|>x<|b|>y", "a") == "x"


# ---------------------------------------------------------------------------------------- next-edit
NEXT_EDIT = """<|recently_viewed_code_snippets|>
<|recently_viewed_code_snippet|>
code_snippet_file_path: util.py
def helper(v):
    return v * 2
<|/recently_viewed_code_snippet|>
<|/recently_viewed_code_snippets|>
<|current_file_content|>
current_file_path: main.py
import util

def run(total):
    x = util.helper(total)
    print(count)
    y = x + 1
    return count
<|/current_file_content|>
<|code_to_edit|>
def run(total):
    x = util.helper(total)
    print(count)
    y = x<|cursor|> + 1
    return count
<|/code_to_edit|>
<|edit_diff_history|>
--- main.py
+++ main.py
@@ -1,3 +1,3 @@
-def run(count):
-    x = util.helper(count)
+def run(total):
+    x = util.helper(total)
<|/edit_diff_history|>"""


def test_next_edit_plan_rewrites_only_the_chosen_spans():
    req = parse_next_edit_prompt(NEXT_EDIT)
    assert req.file_path == "main.py" and req.file_before == "import util\n\n" and req.file_after == ""
    assert req.snippets == ["def helper(v):\n    return v * 2"]
    assert removed_names(req.history) == {"count"}
    plan = plan_next_edit(req)
    rewrites = [p.original for p in plan.pieces if isinstance(p, Rewrite)]
    assert rewrites == ["    print(count)", " + 1", "    return count"]   # stale lines; the cursor's line from it
    assert plan.render() == req.code_to_edit
    answers = {i: f"<{i}>" for i in plan.open_pieces()}
    out = plan.render(answers)
    assert out == "def run(total):\n    x = util.helper(total)\n<1>\n    y = x<3>\n<5>"
    before, after = plan.context(plan.open_pieces()[1])
    assert before.startswith("def helper(v):") and before.endswith("    y = x") and after.startswith("\n    return")


def test_next_edit_nested_region_and_no_cursor():
    msg = ("<|current_file_content|>\ncurrent_file_path: a.py\nA = 1\n<|code_to_edit|>\nB = 2<|cursor|>\n"
           "<|/code_to_edit|>\nC = 3\n<|/current_file_content|>\n<|edit_diff_history|>\n<|/edit_diff_history|>")
    req = parse_next_edit_prompt(msg)
    assert (req.file_before, req.code_to_edit, req.file_after, req.cursor) == ("A = 1\n", "B = 2", "C = 3", 5)
    req.cursor = None
    assert plan_next_edit(req).open_pieces() == []
    with pytest.raises(InvalidRequestError, match="code_to_edit"):
        parse_next_edit_prompt("<|current_file_content|>\nx\n<|/current_file_content|>")


# ---------------------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def fim_server(unmask_dir, tmp_path_factory):
    srv = Server(unmask_dir, tmp_path_factory.mktemp("fim") / "server.log").wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def span_server(family_dirs, tmp_path_factory):
    srv = Server(family_dirs["llada"], tmp_path_factory.mktemp("span") / "server.log").wait_ready()
    yield srv
    srv.stop()


def post(server, path, body) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def sse_frames(server, path, body) -> list:
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[len("data: "):] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


FIM = {"prompt": "def add(a, b):\n    return ", "suffix": "\n\nprint(add(1, 2))\n", "max_tokens": 12}


@pytest.mark.parametrize("which", ["fim_server", "span_server"])
def test_fim_endpoint_streamed_and_not_agree(which, request):
    server = request.getfixturevalue(which)
    r = post(server, "/v1/fim/completions", FIM)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and len(body["choices"]) == 1
    choice = body["choices"][0]
    assert choice["finish_reason"] in ("stop", "length")
    assert 0 < body["usage"]["completion_tokens"] <= 12
    streamed = {**FIM, "stream": True, "stream_options": {"include_usage": True}}
    frames = sse_frames(server, "/v1/fim/completions", streamed)
    content = [f for f in frames if f["choices"]]
    assert "".join(f["choices"][0]["text"] for f in content) == choice["text"]
    assert [f["choices"][0]["finish_reason"] for f in content if f["choices"][0]["finish_reason"]] == \
        [choice["finish_reason"]]
    assert frames[-1]["choices"] == [] and frames[-1]["usage"] == body["usage"]
    # /v1/completions honours suffix the same way
    legacy = post(server, "/v1/completions", FIM).json()
    assert legacy["choices"][0]["text"] == choice["text"]


def test_fim_text_and_stop(fim_server):
    r = post(fim_server, "/v1/fim/completions", {**FIM, "max_tokens": 16, "n": 2, "seed": 3, "temperature": 1.0})
    texts = [c["text"] for c in r.json()["choices"]]
    assert all(texts) and all(set(t) <= set(string.ascii_letters + string.digits + " ") for t in texts)
    stop = texts[0][1:4]
    cut = post(fim_server, "/v1/fim/completions", {**FIM, "max_tokens": 16, "seed": 3, "temperature": 1.0,
                                                   "stop": [stop]}).json()["choices"][0]
    assert cut["text"] == texts[0][:texts[0].index(stop)] and cut["finish_reason"] == "stop"
    # the official client's legacy `suffix` argument
    r = fim_server.client().completions.create(model="tiny-unmask", prompt=FIM["prompt"], suffix=FIM["suffix"],
                                               max_tokens=12)
    assert r.choices[0].text == post(fim_server, "/v1/fim/completions", FIM).json()["choices"][0]["text"]
    # a suffix of just <|endoftext|> (Continue's inception provider, for an empty suffix) means no suffix
    a = post(fim_server, "/v1/fim/completions", {**FIM, "suffix": "<|endoftext|>"}).json()
    b = post(fim_server, "/v1/fim/completions", {**FIM, "suffix": ""}).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"] and a["usage"] == b["usage"]


def test_fim_errors(fim_server, span_server, unmask_dir):
    import json

    ctx = json.loads((unmask_dir / "config.json").read_text())["max_position_embeddings"]
    for limit in (ctx - 1, ctx, 10**6):   # every way of leaving no room is the same error
        r = post(fim_server, "/v1/fim/completions", {**FIM, "max_tokens": limit})
        err = r.json()["error"]
        assert r.status_code == 400 and (err["param"], err["code"]) == ("max_tokens", "context_length_exceeded")
    r = post(fim_server, "/v1/fim/completions", {**FIM, "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    # candidate lengths: each in [1, max_tokens] (no longer filtered away in silence); masked-span models only
    for lengths in ([0], [4, 13], []):
        r = post(span_server, "/v1/fim/completions", {**FIM, "infill_lengths": lengths})
        assert r.status_code == 400 and r.json()["error"]["param"] == "infill_lengths", (lengths, r.text)
    r = post(fim_server, "/v1/fim/completions", {**FIM, "infill_lengths": [4, 8]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "infill_lengths"
    assert "fill-in-the-middle tokens" in r.json()["error"]["message"]
    r = post(span_server, "/v1/fim/completions", {"prompt": "", "suffix": "x", "max_tokens": 4})
    assert r.status_code == 200   # LLaDA starts an empty prefix with its BOS


def apply_message(original, snippet):
    return {"messages": [{"role": "user", "content": f"<|original_code|>\n{original}\n<|/original_code|>\n\n"
                                                      f"<|update_snippet|>\n{snippet}\n<|/update_snippet|>"}]}


@pytest.mark.parametrize("which", ["fim_server", "span_server"])
def test_apply_endpoint(which, request):
    server = request.getfixturevalue(which)
    snippet = "# ... existing code ...\ndef f(x):\n    y = x + 2\n    return y\n# ... existing code ..."
    r = post(server, "/v1/apply/completions", apply_message(ORIGINAL, snippet))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["message"]["content"] == ORIGINAL.replace("x + 1", "x + 2")
    assert body["usage"]["completion_tokens"] == 0           # nothing was ambiguous: no model call
    # ambiguous placement: the model picks one of the merges
    r = post(server, "/v1/apply/completions", apply_message(MERCURY_ORIGINAL, MERCURY_SNIPPET))
    assert r.status_code == 200, r.text
    plan = plan_merge(MERCURY_ORIGINAL, MERCURY_SNIPPET)
    (i,) = plan.open_pieces()
    assert r.json()["choices"][0]["message"]["content"] in {plan.render({i: o}) for o in plan.pieces[i].options}
    assert r.json()["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize("which", ["fim_server", "span_server"])
def test_next_edit_endpoint_keeps_unchanged_lines(which, request):
    server = request.getfixturevalue(which)
    r = post(server, "/v1/edit/completions", {"messages": [{"role": "user", "content": NEXT_EDIT}], "max_tokens": 8})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "edit.completion"
    out = body["choices"][0]["message"]["content"]
    plan = plan_next_edit(parse_next_edit_prompt(NEXT_EDIT))
    fixed = [p.text for p in plan.pieces if isinstance(p, Fixed)]
    assert out.startswith(fixed[0])                 # "def run(total):\n    x = util.helper(total)\n"
    at = len(fixed[0])
    for text in fixed[1:]:                          # every fixed piece, in order, byte for byte
        at = out.index(text, at) + len(text)
    assert "<|cursor|>" not in out and body["usage"]["completion_tokens"] > 0
    frames = sse_frames(server, "/v1/edit/completions",
                        {"messages": [{"role": "user", "content": NEXT_EDIT}], "max_tokens": 8, "stream": True,
                         "seed": 0})
    assert frames[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert sum(1 for f in frames if f["choices"] and f["choices"][0]["finish_reason"]) == 1


def test_edit_errors(fim_server):
    user = {"role": "user", "content": NEXT_EDIT}
    for body, param in [({"messages": [user, user]}, "messages"),
                        ({"messages": [user], "n": 2}, "n"),
                        ({"messages": [{"role": "user", "content": "no sections"}]}, "messages"),
                        ({"messages": [user], "tools": []}, "tools")]:
        r = post(fim_server, "/v1/edit/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = post(fim_server, "/v1/apply/completions", {"messages": [{"role": "user", "content": "<|original_code|>x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    # a bad token limit is refused even where the merge needs no model call; the error names the field sent
    snippet = "# ... existing code ...\ndef f(x):\n    y = x + 2\n    return y\n# ... existing code ..."
    for limit, param in (({"max_tokens": -1}, "max_tokens"), ({"max_completion_tokens": 0}, "max_completion_tokens"),
                         ({"max_completion_tokens": 0, "max_tokens": 8}, "max_completion_tokens")):
        r = post(fim_server, "/v1/apply/completions", {**apply_message(ORIGINAL, snippet), **limit})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (limit, r.text)
        r = post(fim_server, "/v1/edit/completions", {"messages": [user], **limit})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (limit, r.text)
