"""unmask.tokenizer: tokenizer.json alone (no transformers import) must encode and decode exactly as
transformers does wherever it is used, and is refused where it would not."""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest

from unmask.defaults import default_model_path
from unmask.tokenizer import Tokenizer, plain_tokenizer

TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "  leading spaces, trailing\t\n\n", "unicode: naïve café 日本語 🙂 \u200b", "",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
    "<tool_call>{\"name\": \"f\"}</tool_call><|eos|>", "x" * 300, "<|im_start", "a<|mask|>b",
]


def _pairs(family_dirs):
    dirs = {"unmask-tiny": default_model_path(), **family_dirs}
    return [(name, d) for name, d in dirs.items() if plain_tokenizer(d) is not None]


def test_plain_path_is_taken_for_the_builtin_model():
    tok = Tokenizer(default_model_path())
    assert tok._plain is not None and tok._hf is None


def test_plain_path_equals_transformers(family_dirs):
    from transformers import AutoTokenizer

    pairs = _pairs(family_dirs)
    assert pairs and pairs[0][0] == "unmask-tiny"
    rng = random.Random(0)
    for name, d in pairs:
        tok = Tokenizer(d)
        hf = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
        assert tok._hf is None, name
        assert tok.vocab_size == len(hf), name
        for text in TEXTS:
            ids = tok.encode(text)
            assert ids == hf.encode(text, add_special_tokens=False), (name, text)
            for skip in (True, False):
                assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), (name, text, skip)
        for _ in range(50):  # arbitrary id sequences, special tokens and broken UTF-8 included
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 12))]
            for skip in (True, False):
                assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), (name, ids, skip)
        for t in ("<|im_end|>", "<|mask|>", "<|fim_middle|>", "no-such-token", "a"):
            want = hf.convert_tokens_to_ids(t)
            want = None if want is None or (want == hf.unk_token_id and t != hf.unk_token) else want
            assert tok.token_id(t) == want, (name, t)
        assert tok.has_chat_template == bool(hf.chat_template), name


def test_plain_path_is_refused_when_the_config_changes_behaviour(tmp_path):
    src = default_model_path()
    for change in ({"clean_up_tokenization_spaces": True}, {"tokenizer_class": "LlamaTokenizerFast"},
                   {"add_bos_token": True}, {"bos_token": "<|not-special|>"},
                   {"added_tokens_decoder": {"40": {"content": "9", "special": True}}}):  # a plain vocab entry
        d = tmp_path / "t"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        shutil.copy(src / "tokenizer.json", d / "tokenizer.json")
        cfg = json.loads((src / "tokenizer_config.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps({**cfg, **change}))
        assert plain_tokenizer(d) is None, change


def test_generate_cli_does_not_import_transformers():
    code = ("import sys\nfrom unmask.engine.llm import LLM\nfrom unmask.engine.params import GenerationParams\n"
            "llm = LLM()\nout = llm.generate('def f(x):', GenerationParams(max_tokens=4))[0]\n"
            "assert len(out.token_ids) == 4\nprint('transformers' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


def test_token_bytes_are_the_bytes_each_piece_stands_for():
    """OpenAI's logprob `bytes`: a piece holding part of a UTF-8 character gives that byte, not U+FFFD's."""
    tok = Tokenizer(default_model_path())
    text = "日本 café x"
    ids = tok.encode(text)
    parts = [tok.token_bytes(i) for i in ids]
    assert b"".join(parts) == text.encode()
    assert any(tok.decode([i]) == "\ufffd" and len(p) == 1 for i, p in zip(ids, parts))   # partial characters
    assert tok.token_bytes(tok.token_id("<|im_end|>")) == b"<|im_end|>"                   # specials as written
    # the HF path of the same tokenizer agrees
    hf = Tokenizer(default_model_path())
    hf._plain = None
    assert [hf.token_bytes(i) for i in ids] == parts


def test_transformers_imported_from_two_threads_at_once():
    """`unmask serve` loads the tokenizer and the embedding model in two threads; transformers' lazy package
    raises "cannot import name" when both first import from it at once (it did, every start), so both go through
    from_transformers' lock. A fresh interpreter, as at server start."""
    import subprocess
    import sys

    script = (
        "import threading\n"
        "from unmask.tokenizer import from_transformers\n"
        "errors = []\n"
        "def load(name):\n"
        "    try:\n"
        "        from_transformers(name)\n"
        "    except Exception as e:\n"
        "        errors.append(repr(e))\n"
        "ts = [threading.Thread(target=load, args=(n,)) for n in ('AutoTokenizer', 'AutoModel')]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "print(errors)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
