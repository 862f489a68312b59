"""Held-out evaluation: task construction and scoring."""
from types import SimpleNamespace

from unmask.engine.outputs import RequestOutput
from unmask.evaluation import Task, evaluate, infill_tasks, next_line_tasks
from unmask.train.corpus import CorpusFile

CODE = "\n".join(["import os", "", "", "def f(x):", "    y = x + 1", "    return y * 2", ""] * 40)


def test_next_line_tasks_are_deterministic_code_lines():
    docs = [CorpusFile("stdlib", f"m{i}.py", CODE) for i in range(5)] + [CorpusFile("docs", "a.rst", CODE)]
    a, b = next_line_tasks(docs), next_line_tasks(docs)
    assert a == b and len(a) > 0
    for t in a:
        assert t.target in {"import os", "def f(x):", "    y = x + 1", "    return y * 2"}
        assert CODE.find(t.prompt + "\n" + t.target) >= 0  # the prompt is the text before the line's newline
        assert t.lead == "\n" and t.stop == ("\n",) and t.min_tokens == 1
        assert t.answer("\n" + t.target + "\nmore") == t.target and t.answer(" x\n" + t.target) == " x"


def test_infill_tasks_use_single_line_fim_records():
    recs = [{"kind": "fim", "span": "line", "fim": {"prefix": "a = ", "suffix": "\nb", "middle": "1 + 2"}},
            {"kind": "fim", "span": "block", "fim": {"prefix": "x", "suffix": "y", "middle": "z\n"}},
            {"kind": "explain", "messages": []}]
    (t,) = infill_tasks(recs)
    assert t.prompt == "<|fim_prefix|>a = <|fim_suffix|>\nb<|fim_middle|>" and t.target == "1 + 2"


class FakeLLM:
    def __init__(self, answers):
        self.answers = answers

    def encode(self, text):
        return [1, 2, 3]

    def generate(self, prompts, params):
        assert all(p.stop == ["\n"] and p.min_tokens == 1 and p.policy == "topk" and p.tokens_per_step == 1
                   for p in params)
        return [RequestOutput("r", [1], [7] * 4, text, "stop", forwards=2) for text in self.answers]


def test_evaluate_scores_exact_match_and_tokens_per_forward():
    tasks = [Task("next_line", "p", "x = 1", ("\n",), lead="\n"), Task("next_line", "p", "y = 2", ("\n",), lead="\n")]
    r = evaluate(FakeLLM(["\nx = 1  \nz = 0", "\ny = 3"]), tasks, "one_token_per_forward")
    assert r.accuracy == 0.5 and r.n == 2
    assert r.tokens == 8 and r.forwards == 4 and r.tokens_per_forward == 2.0
    assert r.edit_similarity == (1.0 + 0.8) / 2  # "y = 3" vs "y = 2": 4 of 5 characters match


def test_edit_similarity_hand_made():
    from unmask.evaluation import edit_similarity

    assert edit_similarity("", "") == 1.0 and edit_similarity("abc", "") == 0.0
    assert edit_similarity("return a + b", "return a + b") == 1.0
    assert edit_similarity("abcd", "abce") == 0.75
