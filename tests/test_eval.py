"""Held-out evaluation: task construction and scoring."""
from types import SimpleNamespace

from unmask.engine.outputs import RequestOutput
from unmask.evaluation import (Task, evaluate, function_tasks, infill_tasks, next_line_tasks, python_so_far,
                               repeat_rate)
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


FUNCS = "\n".join(["import os", "", "", "def f(x):", "    y = x + 1", "    return y * 2", "",
                    "class A:", "    def g(self):", "        return 1", "    x = 3", "", "def h(): pass", ""] * 20)


def test_function_tasks_take_the_body_after_a_def_line():
    docs = [CorpusFile("stdlib", f"m{i}.py", FUNCS) for i in range(4)] + [CorpusFile("docs", "a.rst", FUNCS)]
    tasks = function_tasks(docs)
    assert tasks == function_tasks(docs) and tasks  # deterministic
    assert {t.header for t in tasks} <= {"def f(x):", "    def g(self):"}  # `def h(): pass` has no body below
    for t in tasks:
        assert t.kind == "function" and t.stop == () and FUNCS.find(t.prompt + t.target) >= 0
        assert t.prompt.endswith(t.header)
        assert t.target in ("\n    y = x + 1\n    return y * 2", "\n        return 1")
        assert t.answer("\n    y = 1\n    ret") == "\n    y = 1" and t.answer("    ret") == ""


def test_python_so_far_accepts_incomplete_code_and_rejects_errors():
    assert python_so_far("def f(x):", "\n    y = (x +")        # unclosed bracket: incomplete, not wrong
    assert python_so_far("    def g(self):", "\n        return 1")  # a method's indent is removed
    assert python_so_far("def f(x):", "")                   # nothing generated yet
    assert python_so_far("    def g(self):", "")           # nothing generated yet under a method
    assert not python_so_far("def f(x):", "\n    return )")
    assert not python_so_far("def f(x):", "\nreturn 1")      # the body must be indented


def test_repeat_rate_counts_repeated_ngrams():
    assert repeat_rate([1, 2, 3, 4, 5]) == 0.0 and repeat_rate([1, 2]) == 0.0
    assert repeat_rate([7] * 10) == 6 / 7                  # every 4-gram after the first repeats it
    assert repeat_rate([1, 2, 3, 4, 1, 2, 3, 4]) == 1 / 5  # (1, 2, 3, 4) twice among five


def test_each_policy_run_pays_its_own_prefills(family_dirs):
    """The engine's prefix cache is emptied first: a second run of the same tasks counts the same forwards.
    (A small step budget gives the prompts prefill forwards of their own, which a warm cache would skip.)"""
    from unmask.engine.llm import LLM

    llm = LLM(family_dirs["sdar"], max_batch_tokens=32)
    tasks = [Task("next_line", "x" * 60 + str(i), "y", ("\n",), lead="\n") for i in range(3)]
    first = evaluate(llm, tasks, "one_token_per_forward")
    second = evaluate(llm, tasks, "one_token_per_forward")
    assert first.forwards == second.forwards and first.tokens == second.tokens


def test_next_token_loss_is_the_causal_cross_entropy(tmp_path):
    """Against a hand computation: one packed row, next-token CE under causal attention, built-in family."""
    import torch
    import torch.nn.functional as F

    from unmask.engine.llm import LLM
    from unmask.evaluation import next_token_loss
    from unmask.models.transformer import CAUSAL

    llm = LLM()
    docs = [CorpusFile("stdlib", "m.py", CODE[:400])]
    ids = llm.tokenizer.encode(CODE[:400])
    x = torch.tensor([ids + [llm.tokenizer.token_id("<|endoftext|>")]])
    x = x[:, :min(x.shape[1], 512)]
    with torch.no_grad():
        logits = llm.model.logits(llm.model.forward_dense(x, torch.arange(x.shape[1])[None], CAUSAL)[:, :-1])
    expected = float(F.cross_entropy(logits[0], x[0, 1:]))
    got = next_token_loss(llm, docs, seq_len=x.shape[1])
    assert abs(got - expected) < 1e-4 and 0 < got < 10


def test_masked_token_loss_reads_a_causal_context_model_with_its_own_mask(tmp_path):
    """A checkpoint whose config says causal_context is scored under the mask it decodes with, not the
    block-causal one (the same weights give a different number under the other)."""
    import json
    import shutil

    import torch

    from unmask.defaults import default_model_path
    from unmask.engine.llm import LLM
    from unmask.evaluation import masked_token_loss
    from unmask.train.data import pack_documents
    from unmask.train.objectives import Objective, diffusion_loss_sum, draw_noise

    model_dir = tmp_path / "m"
    shutil.copytree(default_model_path(), model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**cfg, "causal_context": True}))
    llm = LLM(str(model_dir))
    docs = [CorpusFile("stdlib", "m.py", CODE[:400])]
    got = masked_token_loss(llm, docs, 4, seq_len=64)

    rows = pack_documents([llm.tokenizer.encode(CODE[:400])], 64, llm.tokenizer.token_id("<|endoftext|>")).ids.long()

    def by_hand(causal_context: bool) -> float:
        obj = Objective(mask_id=3, block_sizes=(4,), shift=True, causal_context=causal_context)
        noise = draw_noise(obj, torch.ones_like(rows, dtype=torch.bool), torch.Generator().manual_seed(0))
        with torch.no_grad():
            return float(diffusion_loss_sum(llm.model, rows, noise, obj)) / rows.numel()

    assert abs(got - by_hand(True)) < 1e-5
    assert abs(got - by_hand(False)) > 1e-3


def test_chat_endings_prompt_up_to_the_last_assistant_turn_and_count_stops_per_kind():
    from unmask.evaluation import chat_endings

    class ChatLLM:
        def __init__(self):
            self.prompts, self.params = [], None

        def chat_prompt(self, messages, tools=None):
            self.prompts.append(([m["content"] for m in messages], tools))
            return [len(self.prompts)]

        def generate(self, prompts, params):
            self.params = params
            reasons = {1: "stop", 2: "length", 3: "stop"}
            texts = {1: "a1", 2: "x", 3: '{"name": "f", "arguments": {"a": 1}}'}
            return [RequestOutput("r", p, [7] * (3 if reasons[p[0]] == "stop" else params.max_tokens), texts[p[0]],
                                  reasons[p[0]], forwards=1) for p in prompts]

    records = [
        {"kind": "explain", "messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]},
        {"fim": {"prefix": "a", "suffix": "b", "middle": "c"}, "kind": "fim"},  # no conversation: skipped
        {"kind": "explain", "messages": [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"},
                                         {"role": "user", "content": "q3"}, {"role": "assistant", "content": "a3"}]},
        {"kind": "tool_call", "tools": [{"type": "function"}],
         "messages": [{"role": "user", "content": "q4"}, {"role": "assistant", "content": "", "tool_calls": [
             {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]},
        {"kind": "json", "messages": [{"role": "user", "content": "beyond the limit"},
                                      {"role": "assistant", "content": "a5"}]},
    ]
    llm = ChatLLM()
    results = chat_endings(llm, records, limit=3, max_tokens=16)
    assert llm.prompts == [(["q1"], None), (["q2", "a2", "q3"], None), (["q4"], [{"type": "function"}])]
    assert llm.params.max_tokens == 16 and llm.params.temperature == 0.0 and llm.params.block_size is None
    by_kind = {r.kind: r for r in results}
    assert [r.kind for r in results] == ["explain", "tool_call"]
    assert (by_kind["explain"].n, by_kind["explain"].ended, by_kind["explain"].tokens) == (2, 1, 3 + 16)
    assert by_kind["explain"].rate == 0.5 and by_kind["explain"].mean_length == 9.5
    assert (by_kind["tool_call"].n, by_kind["tool_call"].ended, by_kind["tool_call"].rate) == (1, 1, 1.0)
    # similarity to the reference answer: "a1" matches exactly, "x" shares nothing with "a3"; the tool call is
    # compared as the template writes it, and it is the only record whose reference is JSON
    assert by_kind["explain"].mean_similarity == 0.5 and by_kind["tool_call"].mean_similarity == 1.0
    assert (by_kind["explain"].json_n, by_kind["tool_call"].json_n, by_kind["tool_call"].json_valid) == (0, 1, 1)
    llm = ChatLLM()  # block size and penalties reach every answer; None keeps the default
    chat_endings(llm, records[:1], block_size=4, repetition_penalty=1.2, frequency_penalty=None)
    assert (llm.params.block_size, llm.params.repetition_penalty, llm.params.frequency_penalty) == (4, 1.2, 0.0)
