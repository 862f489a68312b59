"""N-gram draft tables (`decoding.ngram_drafts`, `unmask ngram-drafts`): the counting against a brute-force
reference, drafting, the file's identity checks, and in the engine the same output as next-token decoding in
fewer forwards than without the table."""
import inspect
import json
import random
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from unmask.decoding import ngram_drafts as nd
from unmask.engine.params import GenerationParams
from unmask.errors import InvalidRequestError, ModelLoadError

from test_speculative import AR, MODEL, code_prompts, one_by_one  # noqa: F401  (the shared model and prompts)


def reference_table(docs, max_n, min_count):
    """{context tuple: most frequent follower}, counted the slow way (ties: the smaller token id)."""
    counts = Counter()
    for doc in docs:
        for n in range(1, max_n + 1):
            for i in range(len(doc) - n):
                counts[tuple(doc[i:i + n]), doc[i + n]] += 1
    best = {}
    for (ctx, nxt), c in counts.items():
        old = best.get(ctx)
        if old is None or c > old[1] or (c == old[1] and nxt < old[0]):
            best[ctx] = (nxt, c)
    return {ctx: nxt for ctx, (nxt, c) in best.items() if c >= min_count}


def table_dict(table: nd.NgramTable):
    bits, out = table.bits, {}
    for n, (keys, nexts) in enumerate(zip(table.keys, table.nexts), start=1):
        assert (np.diff(keys) > 0).all()   # sorted, unique: what the binary search needs
        for code, nxt in zip(keys.tolist(), nexts.tolist()):
            ctx = tuple((code >> (bits * (n - 1 - j))) & ((1 << bits) - 1) for j in range(n))
            out[ctx] = nxt
    return out


@pytest.mark.parametrize("vocab, min_count", [(5, 1), (5, 3), (12, 2), (8192, 1)])
def test_the_table_is_the_most_frequent_follower_of_every_context(vocab, min_count):
    rng = random.Random(vocab * 10 + min_count)
    docs = [[rng.randrange(min(vocab, 6)) for _ in range(rng.randrange(0, 60))] for _ in range(30)]
    table = nd.count(docs, vocab, "t", max_n=4, min_count=min_count)
    assert table_dict(table) == reference_table(docs, 4, min_count)
    assert table.source_tokens == sum(map(len, docs))


def test_ngrams_never_span_two_documents_and_ties_take_the_smaller_token():
    table = nd.count([[1, 2], [3, 4]], 8, "t", max_n=2, min_count=1)
    assert table.next_token([2]) is None          # 2 ends the first document: nothing follows it
    assert table.next_token([1]) == 2 and table.next_token([3]) == 4
    tie = nd.count([[1, 5], [1, 3]], 8, "t", max_n=1, min_count=1)
    assert tie.next_token([1]) == 3


def test_drafts_follow_the_longest_known_context():
    # after "1 2" comes 3 (twice); after "2" alone mostly 7; a draft from "... 1 2" takes the longer context
    docs = [[1, 2, 3, 9], [1, 2, 3, 9], [2, 7], [2, 7], [2, 7], [3, 9, 4]]
    table = nd.count(docs, 16, "t", max_n=3, min_count=1)
    assert table.draft([5, 1, 2], 3) == [3, 9, 4]     # "1 2" -> 3, "2 3" -> 9, "3 9" -> 4, then "9 4": unknown
    assert table.draft([6, 2], 2) == [7]              # "6 2" unseen: "2" -> 7; then "2 7" ends its documents
    assert table.draft([15], 4) == []                  # a token never seen drafts nothing
    assert table.draft([1, 2], 0) == []


def test_contexts_are_as_long_as_63_bits_allow():
    assert nd.longest_context(8192) == 4
    assert nd.longest_context(151_936) == 3            # 18 bits a token
    assert nd.count([[1, 2, 3, 4, 5]], 151_936, "t", max_n=4, min_count=1).max_n == 3
    with pytest.raises(ValueError, match="outside the vocabulary of 4"):
        nd.count([[1, 9]], 4, "t")


def test_the_file_keeps_the_table_and_refuses_another_tokenizer_or_vocabulary(tmp_path):
    table = nd.count([[1, 2, 3, 1, 2, 3]], 16, "a" * 64, max_n=3, min_count=1)
    path = nd.save(table, tmp_path / nd.FILE)
    back = nd.load(path, 16, "a" * 64)
    assert table_dict(back) == table_dict(table) and back.min_count == 1 and back.source_tokens == 6
    with pytest.raises(nd.TableMismatch, match="counted with another tokenizer .sha256 aaaaaaaaaaaa, the model's "
                                               "bbbbbbbbbbbb.: rebuild it with `unmask ngram-drafts`"):
        nd.load(path, 16, "b" * 64)
    with pytest.raises(nd.TableMismatch, match="vocabulary of 16 tokens, the model has 32"):
        nd.load(path, 32, "a" * 64)
    (tmp_path / "junk.safetensors").write_bytes(b"not a table")
    with pytest.raises(nd.TableMismatch, match="cannot read the n-gram draft table"):
        nd.load(tmp_path / "junk.safetensors", 16, None)


# --- the command and the engine, on the 5.25M model (a copy of its directory that gets a table) -------------


def stdlib_text(out: Path) -> Path:
    """A JSONL of standard-library sources (present on every machine), the kind of text the model trained on."""
    import argparse
    import json.decoder
    import textwrap

    with out.open("w") as f:
        for module in (argparse, textwrap, json.decoder, inspect):
            f.write(json.dumps({"text": Path(module.__file__).read_text()}) + "\n")
    return out


@pytest.fixture(scope="module")
def with_table(tmp_path_factory):
    """The 5.25M model's files linked into a folder, and a table counted there by `unmask ngram-drafts`."""
    root = tmp_path_factory.mktemp("ngram")
    model = root / "model"
    model.mkdir()
    for f in MODEL.iterdir():
        (model / f.name).symlink_to(f.resolve())
    text = stdlib_text(root / "text.jsonl")
    r = subprocess.run([sys.executable, "-m", "unmask.cli", "ngram-drafts", "-m", str(model), "--text", str(text),
                        "--min-count", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "contexts of 1-4 tokens (min count 2); wrote" in r.stdout
    assert (model / nd.FILE).is_file()
    return model


def test_the_command_says_in_one_line_what_is_wrong(tmp_path, with_table):
    r = subprocess.run([sys.executable, "-m", "unmask.cli", "ngram-drafts", "-m", str(with_table), "--text",
                        str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "t.safetensors")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "missing.jsonl: no corpus" in r.stderr and "Traceback" not in r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"content": "x"}) + "\n")
    r = subprocess.run([sys.executable, "-m", "unmask.cli", "ngram-drafts", "-m", str(with_table), "--text",
                        str(bad), "--out", str(tmp_path / "t.safetensors")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "bad.jsonl:1: no string 'text'" in r.stderr and "Traceback" not in r.stderr
    flat = tmp_path / "flat.jsonl"
    flat.write_text(json.dumps({"text": "x = 1"}) + "\n")
    r = subprocess.run([sys.executable, "-m", "unmask.cli", "ngram-drafts", "-m", str(with_table), "--text",
                        str(flat), "--own-prompts", "4", "--out", str(tmp_path / "t.safetensors")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no line to cut a prompt before" in r.stderr and "Traceback" not in r.stderr


def test_prompts_for_the_models_own_text_end_before_a_line_and_come_from_the_text_only():
    from unmask.train.data import DataError
    from unmask.train.ngram_table import line_prompts

    texts = ["\n\nfirst\nsecond line\nthird", "no newline here", "\n  \n", "a\nb\n"]
    prompts = line_prompts(texts, 40, seed=3, context_chars=8)
    assert prompts == line_prompts(texts, 40, seed=3, context_chars=8) != line_prompts(texts, 40, seed=4,
                                                                                         context_chars=8)
    allowed = {"\n\nfirst", "first\nsecond line"[-8:], "a", "a\nb"}
    assert set(prompts) <= allowed and len(set(prompts)) >= 3   # ends just before a newline, with some text
    with pytest.raises(DataError, match="no line to cut a prompt before"):
        line_prompts(["one line", "\n"], 1)


def test_the_models_own_continuations_are_counted_with_the_text(tmp_path):
    """--own-prompts: the table is the text's and the model's greedy continuations' counted together (each
    continuation after its prompt's last 4 tokens), exactly the brute-force count of those documents."""
    from unmask.engine.llm import LLM
    from unmask.tokenizer import Tokenizer
    from unmask.train.ngram_table import build_table, line_prompts, text_documents

    text = tmp_path / "text.jsonl"
    import textwrap

    text.write_text(json.dumps({"text": Path(textwrap.__file__).read_text()[:6000]}) + "\n")
    path, table, _ = build_table(MODEL, text, 4, 1, tmp_path / "own.safetensors", own_prompts=6, own_tokens=10,
                                 seed=1, dtype="float32")
    texts = list(text_documents(text))
    tok = Tokenizer(MODEL)
    llm = LLM(MODEL, dtype="float32", device="cpu")
    outs = llm.generate(line_prompts(texts, 6, seed=1), GenerationParams(max_tokens=10, temperature=0.0))
    own = [o.prompt_ids[-4:] + o.token_ids for o in outs]
    assert table.own_tokens == sum(len(o.token_ids) for o in outs) > 0
    docs = [tok.encode(t) for t in texts]
    assert table_dict(table) == reference_table(docs + own, 4, 1)
    assert table_dict(table) != reference_table(docs, 4, 1)   # the continuations added contexts of their own
    loaded = nd.load(path, table.vocab_size, table.tokenizer)
    assert (loaded.own_tokens, loaded.source_tokens) == (table.own_tokens, sum(map(len, docs + own)))


@pytest.fixture(scope="module")
def llm(with_table):
    from unmask.engine.llm import LLM

    return LLM(with_table, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def prompts(llm):
    return [llm.encode(p) for p in code_prompts()]


def test_greedy_output_is_next_token_decoding_in_fewer_forwards_with_the_table(llm, prompts):
    assert llm.engine.traits.ngram_drafts is not None
    ref = one_by_one(llm, prompts, **AR)
    without = one_by_one(llm, prompts, policy="speculative", block_size=4, draft_lookup=8, draft_ngrams=False)
    with_ = one_by_one(llm, prompts, policy="speculative", block_size=4, draft_lookup=8)   # None: the model's table
    assert [o.token_ids for o in with_] == [o.token_ids for o in ref] == [o.token_ids for o in without]
    assert [o.finish_reason for o in with_] == [o.finish_reason for o in ref]
    assert sum(o.forwards for o in with_) < sum(o.forwards for o in without)


def test_sampled_output_is_reproducible_with_the_table(llm, prompts):
    knobs = dict(policy="speculative", block_size=4, draft_lookup=8, temperature=0.8, seed=11)
    a, b = one_by_one(llm, prompts[:2], **knobs), one_by_one(llm, prompts[:2], **knobs)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_asking_for_a_table_the_model_lacks_is_a_400_naming_the_field():
    from unmask.engine.llm import LLM

    plain = LLM(MODEL, dtype="float32", device="cpu")   # the committed 5.25M model ships no table
    with pytest.raises(InvalidRequestError, match="draft_ngrams: this model has no n-gram draft table") as e:
        plain.generate([plain.encode("def f(x):\n")], GenerationParams(max_tokens=4, policy="speculative",
                                                                        draft_lookup=8, draft_ngrams=True))
    assert e.value.param == "draft_ngrams"
    with pytest.raises(InvalidRequestError, match="draft_ngrams must be true, false or null"):
        GenerationParams(draft_ngrams="yes")


def test_a_table_from_another_tokenizer_stops_the_load_in_one_line(tmp_path, with_table):
    model = tmp_path / "model"
    shutil.copytree(with_table, model, symlinks=True)
    table = nd.load(model / nd.FILE, 8192, None)
    (model / nd.FILE).unlink()
    nd.save(nd.NgramTable(table.vocab_size, table.keys, table.nexts, "0" * 64, table.min_count,
                          table.source_tokens), model / nd.FILE)
    from unmask.engine.llm import LLM

    with pytest.raises(ModelLoadError, match=r"ngram_drafts.safetensors was counted with another tokenizer "
                                             r"\(sha256 000000000000"):
        LLM(model, dtype="float32", device="cpu")
    # rebuilding it with the model's own continuations runs the model without the stale table
    from unmask.train.ngram_table import build_table

    assert LLM(model, dtype="float32", device="cpu", ngram_drafts=False).engine.traits.ngram_drafts is None
    build_table(model, stdlib_text(tmp_path / "text.jsonl"), own_prompts=2, own_tokens=4, dtype="float32")
    rebuilt = LLM(model, dtype="float32", device="cpu").engine.traits.ngram_drafts
    assert 0 < rebuilt.own_tokens <= 8 and rebuilt.tokenizer == table.tokenizer


def test_a_trained_export_keeps_the_table_only_with_the_tokenizer_it_was_counted_with(tmp_path, with_table):
    from unmask.train.checkpoint import _keep_ngram_table

    same, other = tmp_path / "same", tmp_path / "other"
    for d in (same, other):
        d.mkdir()
    shutil.copy2(with_table / "tokenizer.json", same / "tokenizer.json")
    (other / "tokenizer.json").write_text("{}")
    _keep_ngram_table(with_table, same)
    _keep_ngram_table(with_table, other)
    assert (same / nd.FILE).read_bytes() == (with_table / nd.FILE).read_bytes()
    assert not (other / nd.FILE).exists()   # a retrained tokenizer: the model would refuse the old table


def test_over_http_draft_ngrams_reaches_the_engine_and_bad_values_are_400s(with_table, tmp_path):
    import time

    from fastapi.testclient import TestClient

    from unmask.server.app import ServerArgs, create_app

    args = ServerArgs(model=with_table, served_model_name="m", dtype="float32", data_dir=tmp_path,
                      embedding_model="off")
    with TestClient(create_app(args)) as http:
        for _ in range(600):
            health = http.get("/health")
            if health.status_code == 200:
                break
            time.sleep(0.1)
        assert health.status_code == 200, f"the model did not load in 60 s: {health.text}"
        body = {"model": "m", "prompt": "def add(a, b):\n", "max_tokens": 16, "temperature": 0,
                "policy": "speculative", "block_size": 4, "draft_lookup": 8}
        texts = []
        for ngrams in (None, False, True):
            r = http.post("/v1/completions", json={**body, "draft_ngrams": ngrams})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        assert texts[0] == texts[1] == texts[2]   # the table changes forwards, never the answer
        r = http.post("/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 8,
                                             "policy": "speculative", "draft_lookup": 8, "draft_ngrams": False})
        assert r.status_code == 200, r.text
        r = http.post("/v1/completions", json={**body, "draft_ngrams": "maybe"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "draft_ngrams", r.text


def test_in_steps_without_diffusion_drafts_the_table_is_verified_beside_a_lookup_copy(llm, prompts, monkeypatch):
    """The second chain is idle where a step has no diffusion drafts; there the table's draft goes beside a
    prompt-lookup copy and wins some steps, with the answers of next-token decoding."""
    from unmask.engine.speculative import SpeculativeSequence

    apply, steps = SpeculativeSequence.apply, []

    def recording(self, plan, logits):
        before, no_diffusion = self.copy_wins, not self.drafts.numel() and plan.targets.numel() > 0
        out = apply(self, plan, logits)
        if no_diffusion:
            steps.append((int(self._alt.numel()) > 0, self.copy_wins > before))
        return out

    monkeypatch.setattr(SpeculativeSequence, "apply", recording)
    got = one_by_one(llm, prompts, policy="speculative", block_size=4, draft_lookup=8)
    assert [o.token_ids for o in got] == [o.token_ids for o in one_by_one(llm, prompts, **AR)]
    offered = [won for alt, won in steps if alt]
    assert offered and any(offered), (len(steps), len(offered))


def test_a_step_drafting_from_the_table_alone_places_its_draft_block_after_none_of_them(llm, prompts, monkeypatch):
    """Where a step's only drafts are the table's, its one draft block goes after none of them (where the table is
    refused, the next step then has diffusion drafts); elsewhere after all; the answers stay next-token decoding's."""
    from unmask.engine.speculative import SpeculativeSequence

    plan, apply, seen = SpeculativeSequence.plan, SpeculativeSequence.apply, []

    def recording_plan(self, budget):
        no_diffusion = not self.drafts.numel()
        out = plan(self, budget)
        if out.targets.numel():
            seen.append(("table" if self._from_table and no_diffusion and self._k else "other", self._k,
                         sorted(self._blocks)))
        return out

    refused_then_drafted = []

    def recording_apply(self, p, logits):
        table = bool(seen) and seen[-1][0] == "table"
        kept = self.kept
        out = apply(self, p, logits)
        if table and self.kept == kept and not self.finish_reason:
            refused_then_drafted.append(self.drafts.numel() > 0)
        return out

    monkeypatch.setattr(SpeculativeSequence, "plan", recording_plan)
    monkeypatch.setattr(SpeculativeSequence, "apply", recording_apply)
    got = one_by_one(llm, prompts, policy="speculative", block_size=4, draft_lookup=8)
    assert [o.token_ids for o in got] == [o.token_ids for o in one_by_one(llm, prompts, **AR)]
    table = [blocks for kind, k, blocks in seen if kind == "table"]
    assert table and all(blocks == [0] for blocks in table)
    assert all(blocks == [k] for kind, k, blocks in seen if kind == "other")
    assert refused_then_drafted and all(refused_then_drafted)
