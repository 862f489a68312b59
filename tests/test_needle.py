"""Needle in a haystack (issue 34, item 2): the prompt is the asked length, the needle sits at the asked depth
on a line of its own, answers are scored by exact match of the value, and `unmask eval --needle` runs end to end."""
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from unmask.cli import app
from unmask.engine.llm import LLM
from unmask.engine.params import GenerationParams
from unmask.evaluation_needle import (KEY, NEEDLE, QUESTION, SNAP_TOKENS, NeedleTask, answer_value, build_task,
                                      build_tasks, is_correct, line_starts, report, run)
from unmask.train.corpus import CorpusFile, write_documents

SOURCE = Path(__file__).resolve().parents[1] / "src" / "unmask"
DOCS = [CorpusFile("stdlib", p.name, p.read_text()) for p in sorted(SOURCE.glob("*.py"))]  # real text, ~1 MB


@pytest.fixture(scope="module")
def llm():
    return LLM()  # the built-in model: its tokenizer merges a newline with the next line's indentation


@pytest.mark.parametrize("length", [256, 1000, 4096])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_prompt_is_the_asked_length_with_the_needle_at_the_asked_depth(llm, length, depth):
    haystack = llm.encode("\n\n".join(d.text for d in DOCS))
    starts = line_starts(llm.tokenizer, llm.spec.arch.vocab_size)
    task = build_task(llm.encode, haystack, starts, length, depth, "73914", offset=5000)
    needle, question = llm.encode(NEEDLE.format(key=KEY, value="73914")), llm.encode(QUESTION.format(key=KEY))
    ids = task.prompt_ids
    assert len(ids) == length
    assert ids[task.needle_start:task.needle_start + len(needle)] == needle
    assert ids[-len(question):] == question
    assert task.haystack_len == length - len(needle) - len(question)
    assert abs(task.needle_start - depth * task.haystack_len) <= SNAP_TOKENS
    if depth == 0.0:
        assert task.needle_start == 0
    elif depth == 1.0:
        assert task.needle_start + len(needle) == length - len(question)  # right before the question
    else:  # a line of its own: the haystack token after it starts a line
        assert ids[task.needle_start + len(needle)] in starts
    around = ids[:task.needle_start] + ids[task.needle_start + len(needle):-len(question)]
    assert around == [haystack[(5000 + i) % len(haystack)] for i in range(task.haystack_len)]  # real text, in order
    assert llm.tokenizer.decode(ids[task.needle_start:]).startswith('\nPASSKEY = "73914"')


def test_tasks_differ_by_value_and_offset_and_repeat_by_seed(llm):
    a = build_tasks(llm, DOCS, [300], [0.5], trials=3, seed=1)
    assert a == build_tasks(llm, DOCS, [300], [0.5], trials=3, seed=1)
    assert len({t.value for t in a}) == 3 and all(len(t.value) == 5 and t.value.isdigit() for t in a)
    assert len({tuple(t.prompt_ids) for t in a}) == 3


def test_answer_scoring_is_exact_match_of_the_value():
    task = NeedleTask(64, 0.5, "73914", [], 0, 0, 0)
    assert answer_value('73914"\n') == "73914"
    for text in ('73914"', "73914", ' 73914"\nPASSKEY', "73914\n"):
        assert is_correct(task, text), text
    for text in ('7391"', '739145"', '73914 7"', '', '"73914"', "7 3914"):
        assert not is_correct(task, text), text


def test_run_scores_each_cell(llm):
    """The model's own answers against a value planted in the prompt: a cell's accuracy is its share of exact
    values, and a copy the model wrote counts (the last depth puts the needle next to the question)."""
    tasks = build_tasks(llm, DOCS, [256], [0.0, 1.0], trials=2, seed=0)
    lines = []
    results = run(llm, tasks, dict(policy="topk", tokens_per_step=1, block_size=1), log=lines.append)
    assert [(r.length, r.depth, r.n) for r in results] == [(256, 0.0, 2), (256, 1.0, 2)]
    assert len(lines) == 2 and lines[0].startswith("needle 256: 4 prompts (0 refused), started ")
    assert re.fullmatch(rf"needle 256: {sum(r.correct for r in results)} of 4 right in \d+ s", lines[1])
    for r in results:
        cell = [t for t in tasks if t.depth == r.depth]
        assert r.values == [t.value for t in cell]
        assert r.correct == sum(is_correct(t, a) for t, a in zip(cell, r.answers))
        assert not r.past_context and r.refused == 0


def test_eval_needle_cli_end_to_end(tmp_path, family_dirs):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_documents(DOCS[:6], corpus / "heldout.jsonl")
    out = tmp_path / "needle.json"
    for model in (None, family_dirs["llada"]):  # the built-in model; a bidirectional tiny checkpoint
        args = ["eval", "--needle", "--corpus", str(corpus), "--needle-lengths", "256,512",
                "--needle-depths", "0,0.5,1", "--needle-trials", "1", "--json", str(out)]
        r = CliRunner().invoke(app, args + (["--model", str(model)] if model else []))
        assert r.exit_code == 0, r.output
        assert "needle in a haystack" in r.stdout and "256" in r.stdout and "512" in r.stdout
        assert "needle 512: 3 prompts (0 refused), started" in r.stderr
        data = json.loads(out.read_text())
        cells = {(c["length"], c["depth"]): c for c in data["results"]}
        assert set(cells) == {(n, d) for n in (256, 512) for d in (0.0, 0.5, 1.0)}
        assert all(c["n"] == 1 and c["accuracy"] in (0.0, 1.0) and len(c["answers"]) == 1 for c in cells.values())


def test_eval_needle_refuses_bad_grids(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_documents(DOCS[:2], corpus / "heldout.jsonl")
    r = CliRunner().invoke(app, ["eval", "--needle", "--corpus", str(corpus), "--needle-depths", "0,1.5"])
    assert r.exit_code != 0 and "--needle-depths" in r.output
    r = CliRunner().invoke(app, ["eval", "--needle", "--corpus", str(corpus), "--needle-policy", "fastest"])
    assert r.exit_code != 0 and "unknown --needle-policy 'fastest'; choose from default, " in r.output


def test_a_length_that_cannot_fit_in_memory_is_refused_not_run(llm, monkeypatch):
    from unmask.engine import memory
    from unmask.evaluation_needle import table

    monkeypatch.setattr(memory, "available_bytes", lambda device: 0)
    (r,) = run(llm, build_tasks(llm, DOCS, [256], [0.5], trials=2), dict(policy="topk", tokens_per_step=1))
    assert (r.n, r.refused, r.correct, r.answers) == (2, 2, 0, [])
    assert "refused" in table([r])
    assert not llm.engine.has_unfinished()


def test_the_default_policy_is_the_models_own(llm):
    """`--needle-policy default` decodes as a request that names no policy: the built-in model's own default
    (generation_config.json: speculative, draft blocks of 4, prompt lookup 8), the eval policy of that name."""
    resolved = llm.engine.resolve_policy(GenerationParams())
    assert (resolved.policy, resolved.block_size, resolved.draft_lookup) == ("speculative", 4, 8)
    own = report(llm, DOCS, [256, 512], [0.0, 1.0], trials=1, policy="default")
    named = report(llm, DOCS, [256, 512], [0.0, 1.0], trials=1, policy="speculative_b4_lookup")
    assert own["policy"] == "default"
    assert [c["answers"] for c in own["results"]] == [c["answers"] for c in named["results"]]
    with pytest.raises(ValueError, match="unknown policy 'fastest'; choose from default, "):
        report(llm, DOCS, [256], [0.0], policy="fastest")
