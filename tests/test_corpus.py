"""Data side of unmask-tiny: corpus, tokenizer, chat template, instruction records.

Runs on a small fake stdlib tree (plus two real stdlib modules) so it is fast and does not
need the python3-doc package.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sysconfig
from pathlib import Path

import pytest

from unmask.train.corpus import (CorpusFile, build_corpus, collect_files, heldout_score,
                                 is_heldout, read_documents, split_files)
from unmask.train.instructions import (build_instructions, first_user_prompt, format_fim,
                                       read_jsonl, write_jsonl)
from unmask.train.tokenizer import (BOS_ID, EOS_ID, IM_END_ID, MASK_ID, PAD_ID, SPECIAL_TOKENS,
                                    render_chat, save_hf_tokenizer, train_tokenizer)

STDLIB = Path(sysconfig.get_paths()["stdlib"])

DOC_RST = """\
:mod:`fakemod` --- A fake module
================================

.. module:: fakemod

.. function:: frobnicate(x, *, strict=False)

   Return *x* frobnicated, see :func:`~fakemod.other` and ``strict``.

   More detail here.

.. class:: Widget(name)

   A thing with a :term:`name <glossary-name>`.

   .. method:: spin(times=1)

      Spin the widget *times* times.
"""

MOD_PY = '''\
"""Tiny helper module used by the corpus tests."""


def add(a, b):
    """Return the sum of a and b."""
    total = a + b
    return total


class Box:
    """A box holding one value."""

    def get(self):
        """Return the stored value."""
        value = self.value
        return value
'''


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("data")
    lib, docs = root / "lib", root / "docs"
    (lib / "pkg").mkdir(parents=True)
    (lib / "pkg" / "__init__.py").write_text('"""A package."""\n')
    (lib / "pkg" / "mod.py").write_text(MOD_PY)
    shutil.copy(STDLIB / "textwrap.py", lib / "textwrap.py")
    shutil.copytree(STDLIB / "json", lib / "json", ignore=shutil.ignore_patterns("__pycache__"))
    # Everything below must be skipped.
    for skipped in ("test/test_x.py", "pkg/tests/test_y.py", "idlelib/shell.py",
                    "site-packages/foo.py"):
        (lib / skipped).parent.mkdir(parents=True, exist_ok=True)
        (lib / skipped).write_text("x = 1\n")
    (lib / "big.py").write_text("x = 1\n" * 40_000)
    (lib / "latin1.py").write_bytes("s = 'caf\xe9'\n".encode("latin-1"))
    (lib / "empty.py").write_text("")
    (lib / "cp_fake.py").write_text('""" Python Character Mapping Codec generated from gencodec.py"""\n')
    (docs / "library").mkdir(parents=True)
    (docs / "library" / "fakemod.rst.txt").write_text(DOC_RST)
    (docs / "index.rst.txt").write_text("Welcome\n=======\n\nHello docs.\n")
    return lib, docs


@pytest.fixture(scope="module")
def files(roots: tuple[Path, Path]) -> list[CorpusFile]:
    lib, docs = roots
    return collect_files(stdlib_dir=lib, docs_dir=docs)


# ---------------------------------------------------------------- corpus

def test_collect_skips_and_sorts(files: list[CorpusFile]) -> None:
    keys = [f.key for f in files]
    assert keys == sorted(keys)
    assert "stdlib/pkg/mod.py" in keys and "stdlib/json/decoder.py" in keys
    assert "docs/library/fakemod.rst" in keys and "docs/index.rst" in keys
    for bad in ("test/", "tests/", "idlelib/", "site-packages/", "big.py", "latin1.py",
                "empty.py", "cp_fake.py"):
        assert not any(bad in k for k in keys), bad


def test_missing_docs_warns_and_continues(roots: tuple[Path, Path]) -> None:
    lib, _ = roots
    with pytest.warns(UserWarning, match="docs not found"):
        got = collect_files(stdlib_dir=lib, docs_dir=lib / "no-such-dir")
    assert got and all(f.source == "stdlib" for f in got)


def test_build_is_deterministic(roots: tuple[Path, Path], tmp_path: Path) -> None:
    lib, docs = roots
    outs = []
    for name in ("a", "b"):
        stats = build_corpus(tmp_path / name, stdlib_dir=lib, docs_dir=docs, heldout_fraction=0.3)
        outs.append({p.name: p.read_bytes() for p in sorted((tmp_path / name).iterdir())})
    assert set(outs[0]) == {"train.jsonl", "heldout.jsonl", "manifest.json"}
    assert outs[0] == outs[1]
    for name, digest in stats.outputs.items():
        assert hashlib.sha256(outs[0][name]).hexdigest() == digest
    manifest = json.loads(outs[0]["manifest.json"])
    assert manifest["train"]["files"] + manifest["heldout"]["files"] == len(manifest["files"])
    docs_back = list(read_documents(tmp_path / "a" / "train.jsonl"))
    assert docs_back and all(d.text for d in docs_back)


def test_split_is_by_file_and_stable(files: list[CorpusFile]) -> None:
    train, held = split_files(files, heldout_fraction=0.3)
    assert sorted(train + held, key=lambda f: f.key) == files  # whole documents, none lost
    assert not {f.key for f in train} & {f.key for f in held}
    # A file's side depends only on its path: same answer inside any subset.
    sub_train, sub_held = split_files(files[::2], heldout_fraction=0.3)
    assert {f.key for f in sub_held} == {f.key for f in held} & {f.key for f in files[::2]}
    assert all(is_heldout(f, 0.3) for f in held)
    # Hash is uniform enough: ~3% of many paths.
    keys = [f"stdlib/m{i}.py" for i in range(4000)]
    frac = sum(heldout_score(k) < 0.03 for k in keys) / len(keys)
    assert 0.02 < frac < 0.04
    assert heldout_score("stdlib/json/decoder.py") == heldout_score("stdlib/json/decoder.py")


# ---------------------------------------------------------------- tokenizer

@pytest.fixture(scope="module")
def tok(files: list[CorpusFile]):
    return train_tokenizer([f.text for f in files], vocab_size=600)


def test_special_ids_fixed(tok) -> None:
    assert SPECIAL_TOKENS == [
        "<|pad|>", "<|bos|>", "<|eos|>", "<|mask|>", "<|im_start|>", "<|im_end|>",
        "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<tool_call>", "</tool_call>",
        "<tool_response>", "</tool_response>", "<|endoftext|>", "<|reserved_0|>",
        "<|reserved_1|>"]
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i
        assert tok.encode(t).ids == [i]
    assert (PAD_ID, BOS_ID, EOS_ID, MASK_ID, IM_END_ID) == (0, 1, 2, 3, 5)
    assert tok.get_vocab_size() <= 600


def test_roundtrip_preserves_whitespace(tok) -> None:
    code = "def f(x):\n\tif x  ==  1:\n        return 'café ☃'  # 🙂\n\n\n   \n"
    ids = tok.encode(code).ids
    assert tok.decode(ids, skip_special_tokens=False) == code
    assert all(i >= len(SPECIAL_TOKENS) for i in ids)


# ---------------------------------------------------------------- chat template

TWO_TURNS = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
TWO_TURNS_TEXT = ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
                  "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "assistant", "content": "21 degrees."},
]
TOOL_CHAT_TEXT = (
    "<|im_start|>system\nYou can call the following tools. Each line is the JSON signature of "
    "one tool:\n" + json.dumps(WEATHER["function"]) + "\nTo call a tool, answer with "
    '<tool_call>{"name": <tool name>, "arguments": {<arguments as JSON>}}</tool_call>, one '
    "block per call.<|im_end|>\n"
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
    "</tool_call><|im_end|>\n"
    '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n'
    "<|im_start|>assistant\n21 degrees.<|im_end|>\n")


def test_chat_template_exact() -> None:
    assert render_chat(TWO_TURNS) == TWO_TURNS_TEXT
    assert render_chat(TWO_TURNS[:1], add_generation_prompt=True) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert render_chat(TOOL_CHAT, tools=[WEATHER]) == TOOL_CHAT_TEXT


def test_hf_directory_loads(tok, tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    save_hf_tokenizer(tok, tmp_path)
    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).token_to_id("<|mask|>") == 3
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id, hf.mask_token_id) == (0, 1, 2, 3)
    assert hf.convert_tokens_to_ids("<|im_end|>") == IM_END_ID
    assert hf.apply_chat_template(TWO_TURNS, tokenize=False) == TWO_TURNS_TEXT
    assert hf.apply_chat_template(TOOL_CHAT, tools=[WEATHER], tokenize=False) == TOOL_CHAT_TEXT
    assert hf.apply_chat_template(TWO_TURNS[:1], tokenize=False, add_generation_prompt=True) \
        == render_chat(TWO_TURNS[:1], add_generation_prompt=True)
    code = "x  =\t[1,  2]\n\n"
    assert hf.decode(hf(code)["input_ids"]) == code
    ids = hf.apply_chat_template(TWO_TURNS, tokenize=True, return_dict=True)["input_ids"]
    assert ids[0] == 4 and ids.count(IM_END_ID) == 4


# ---------------------------------------------------------------- instructions

@pytest.fixture(scope="module")
def records(files: list[CorpusFile]) -> list[dict]:
    return build_instructions(files, seed=7, heldout=False)


def test_instructions_deterministic(files: list[CorpusFile], records: list[dict]) -> None:
    assert build_instructions(files, seed=7, heldout=False) == records
    assert build_instructions(files, seed=8, heldout=False) != records


def test_instruction_records_well_formed(records: list[dict], tmp_path: Path) -> None:
    kinds = {r["kind"] for r in records}
    assert kinds == {"implement", "explain", "fim", "tool_call", "json"}
    for r in records:
        if r["kind"] == "fim":
            continue
        msgs = r["messages"]
        assert msgs[-1]["role"] == "assistant"
        for m in msgs:
            assert m["role"] in {"system", "user", "assistant", "tool"}
            assert m["content"].strip() or m.get("tool_calls")
        if r["kind"] == "tool_call":
            names = {t["function"]["name"] for t in r["tools"]}
            for m in msgs:
                for call in m.get("tool_calls", []):
                    assert call["function"]["name"] in names
                    assert isinstance(call["function"]["arguments"], dict)
            assert "You can call the following tools" in render_chat(msgs, tools=r["tools"])
        if r["kind"] == "json":
            assert isinstance(json.loads(msgs[-1]["content"]), dict)
    explain = {r["messages"][0]["content"]: r["messages"][1]["content"]
               for r in records if r["kind"] == "explain"}
    assert any("`fakemod.frobnicate`" in q for q in explain)
    assert any("`pkg.mod.add`" in q for q in explain)
    path = tmp_path / "sft.jsonl"
    assert write_jsonl(records, path) == len(records)
    assert list(read_jsonl(path)) == records


def test_fim_reassembles(files: list[CorpusFile], records: list[dict]) -> None:
    by_key = {f.key: f.text for f in files}
    fims = [r for r in records if r["kind"] == "fim"]
    assert {r["span"] for r in fims} == {"line", "block"}
    for r in fims:
        fim = r["fim"]
        assert fim["middle"].strip()
        assert fim["prefix"] + fim["middle"] + fim["suffix"] in by_key[r["path"]]
        assert format_fim(r).startswith("<|fim_prefix|>")
    small = [r for r in fims if r["path"] == "stdlib/pkg/mod.py"]
    assert small and all(r["fim"]["prefix"] + r["fim"]["middle"] + r["fim"]["suffix"] == MOD_PY
                         for r in small)
    blocks = [r for r in fims if r["span"] == "block"]
    assert all(r["fim"]["middle"].endswith("\n") and "\n" in r["fim"]["middle"][:-1]
               for r in blocks)


def test_heldout_files_give_heldout_records(files: list[CorpusFile]) -> None:
    train, held = split_files(files, heldout_fraction=0.3)
    assert train and held
    rt = build_instructions(train, seed=1, heldout=False)
    rh = build_instructions(held, seed=1, heldout=True)
    train_keys, held_keys = {f.key for f in train}, {f.key for f in held}
    assert all(r["path"] in train_keys for r in rt if "path" in r)
    assert all(r["path"] in held_keys for r in rh if "path" in r)
    prompts = lambda rs: {first_user_prompt(r) for r in rs if "messages" in r}  # noqa: E731
    assert prompts(rt) and prompts(rh) and not prompts(rt) & prompts(rh)


def test_package_source_adds_training_text_only(roots: tuple[Path, Path], tmp_path: Path) -> None:
    """`unmask corpus --package NAME`: the package's .py files join train.jsonl; heldout.jsonl (the
    model card's evaluation set) is byte-identical to the build without it; its held-out files,
    tests, vendored and generated files are kept out; the manifest records the version."""
    lib, docs = roots
    pkg = tmp_path / "fakepkg"
    for i in range(60):  # enough paths that a few land on the held-out side at 0.3
        (pkg / "sub").mkdir(parents=True, exist_ok=True)
        (pkg / "sub" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n")
    for skipped in ("testing/helpers.py", "tests/test_a.py", "_vendor/six.py", "sub/test_b.py",
                    "conftest.py"):
        (pkg / skipped).parent.mkdir(parents=True, exist_ok=True)
        (pkg / skipped).write_text("x = 1\n")
    (pkg / "gen.py").write_text("# This is an auto-generated file. Please do not modify it by hand.\nx = 1\n")

    plain = build_corpus(tmp_path / "plain", stdlib_dir=lib, docs_dir=docs, heldout_fraction=0.3)
    stats = build_corpus(tmp_path / "with", stdlib_dir=lib, docs_dir=docs, heldout_fraction=0.3,
                         packages=["fakepkg"], package_dirs={"fakepkg": (pkg, "1.2.3")})
    assert (tmp_path / "with" / "heldout.jsonl").read_bytes() == (tmp_path / "plain" / "heldout.jsonl").read_bytes()
    assert stats.outputs["heldout.jsonl"] == plain.outputs["heldout.jsonl"]

    train_keys = {d.key for d in read_documents(tmp_path / "with" / "train.jsonl")}
    held_pkg = {d.key for d in read_documents(tmp_path / "with" / "heldout-packages.jsonl")}
    expected = {f"pkg:fakepkg/sub/m{i}.py" for i in range(60)}
    assert held_pkg and held_pkg < expected
    assert {k for k in train_keys if k.startswith("pkg:")} == expected - held_pkg
    assert all(is_heldout(CorpusFile("pkg:fakepkg", k.split("/", 1)[1], "x"), 0.3) for k in held_pkg)
    assert train_keys - expected == {d.key for d in read_documents(tmp_path / "plain" / "train.jsonl")}

    manifest = json.loads((tmp_path / "with" / "manifest.json").read_text())
    assert manifest["packages"] == {"fakepkg": "1.2.3"}
    assert manifest["sources"]["pkg:fakepkg"]["files"] == 60
    assert manifest["heldout_packages"]["files"] == len(held_pkg)
    splits = {f["split"] for f in manifest["files"] if f["source"] == "pkg:fakepkg"}
    assert splits == {"train", "heldout-packages"}


def test_unknown_package_is_refused_before_writing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="^--package: 'no_such_pkg_xyz' is not an installed Python package$"):
        build_corpus(tmp_path / "out", packages=["no_such_pkg_xyz"])
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- bad input: outputs, packages, data files

from typer.testing import CliRunner  # noqa: E402

from unmask.cli import app  # noqa: E402
from unmask.train import corpus as corpus_module  # noqa: E402
from unmask.train.corpus import write_documents  # noqa: E402
from unmask.train.data import DataError, read_corpus_jsonl  # noqa: E402

OLD = b'{"old": true}\n'


def _cli(*args: str):
    return CliRunner().invoke(app, list(args))


def _one_error(r) -> str:
    """The single stderr line of a refused run."""
    assert r.exit_code == 1, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


@pytest.fixture
def outputs(tmp_path: Path, roots: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """`unmask corpus` on the tiny roots, with an earlier build's files (OLD) in every output folder."""
    lib, docs = roots
    monkeypatch.setattr(corpus_module, "default_stdlib_dir", lambda: lib)
    monkeypatch.setattr(corpus_module, "default_docs_dir", lambda: docs)
    dirs = {"--out": tmp_path / "corpus", "--tokenizer-out": tmp_path / "tok", "--sft-out": tmp_path / "sft"}
    for flag, name in (("--out", "train.jsonl"), ("--out", "manifest.json"), ("--tokenizer-out", "tokenizer.json"),
                       ("--sft-out", "train.jsonl")):
        dirs[flag].mkdir(exist_ok=True)
        (dirs[flag] / name).write_bytes(OLD)
    return dirs


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("flag", ["--out", "--tokenizer-out", "--sft-out"])
@pytest.mark.parametrize("bad", ["file", "under-file", "proc"])
def test_corpus_cli_refuses_unwritable_output_before_building(outputs: dict[str, Path], tmp_path: Path,
                                                               flag: str, bad: str) -> None:
    """Used to build the corpus and tokenizer, then die on the bad flag with a FileNotFoundError or
    FileExistsError traceback, old outputs already rewritten. Now: one line naming the flag, nothing touched."""
    (tmp_path / "a-file").write_text("keep me\n")
    target = {"file": tmp_path / "a-file", "under-file": tmp_path / "a-file" / "sub",
              "proc": Path("/proc/no-such-dir/sub")}[bad]
    before = _tree(tmp_path)
    args = {**{k: str(v) for k, v in outputs.items()}, flag: str(target)}
    line = _one_error(_cli("corpus", *(x for kv in args.items() for x in kv)))
    assert line.startswith(f"error: {flag} {target} is not a writable directory: ")
    assert _tree(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "corpus", "sft", "tok"]


def test_corpus_cli_refuses_out_equal_to_sft_out(outputs: dict[str, Path], tmp_path: Path) -> None:
    """Both write train.jsonl: the instruction data used to overwrite the corpus silently."""
    before = _tree(tmp_path)
    line = _one_error(_cli("corpus", "--out", str(outputs["--out"]), "--tokenizer-out", str(outputs["--tokenizer-out"]),
                           "--sft-out", str(outputs["--out"]) + "/"))
    assert line == (f"error: --out and --sft-out are the same directory {outputs['--out']}: "
                    "the instruction data would overwrite the corpus")
    assert _tree(tmp_path) == before


def test_corpus_cli_builds_and_replaces_outputs(outputs: dict[str, Path]) -> None:
    args = [x for kv in outputs.items() for x in (kv[0], str(kv[1]))]
    r = _cli("corpus", *args)
    assert r.exit_code == 0, r.output
    out, tok, sft = outputs.values()
    assert sorted(p.name for p in out.iterdir()) == ["heldout.jsonl", "manifest.json", "train.jsonl"]
    assert sorted(p.name for p in tok.iterdir()) == ["special_tokens_map.json", "tokenizer.json",
                                                    "tokenizer_config.json"]
    assert sorted(p.name for p in sft.iterdir()) == ["heldout.jsonl", "train.jsonl"]  # no temp files left
    assert all(p.read_bytes() != OLD for d in outputs.values() for p in d.iterdir())
    assert {d.key for d in read_documents(out / "train.jsonl")} >= {"stdlib/pkg/mod.py"}


def test_corpus_cli_failure_midway_keeps_old_files_whole(outputs: dict[str, Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails midway (disk full) used to leave a truncated file and a traceback."""
    import unmask.train.tokenizer as tokenizer_module

    def half_save(tok, out_dir):
        (Path(out_dir) / "tokenizer.json").write_text('{"trunc')
        raise OSError(28, "No space left on device", str(Path(out_dir) / "tokenizer_config.json"))

    monkeypatch.setattr(tokenizer_module, "save_hf_tokenizer", half_save)
    args = [x for kv in outputs.items() for x in (kv[0], str(kv[1]))]
    line = _one_error(_cli("corpus", *args))
    assert line.startswith("error: cannot write ") and line.endswith(": No space left on device")
    tok = outputs["--tokenizer-out"]
    assert _tree(tok) == {"tokenizer.json": OLD} and [p.name for p in tok.iterdir()] == ["tokenizer.json"]
    assert (outputs["--sft-out"] / "train.jsonl").read_bytes() == OLD


@pytest.mark.parametrize("writer", ["documents", "jsonl"])
def test_writers_replace_atomically(tmp_path: Path, writer: str) -> None:
    path = tmp_path / "out.jsonl"
    path.write_bytes(OLD)

    def rows():
        yield CorpusFile("stdlib", "a.py", "x = 1\n") if writer == "documents" else {"a": 1}
        raise RuntimeError("boom")

    write = (lambda: write_documents(rows(), path)) if writer == "documents" else (lambda: write_jsonl(rows(), path))
    with pytest.raises(RuntimeError, match="boom"):
        write()
    assert path.read_bytes() == OLD and [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


def test_stdlib_package_is_refused(roots: tuple[Path, Path], tmp_path: Path) -> None:
    """`--package json` duplicated stdlib files; `--package dbm` put stdlib's held-out dbm/ndbm.py into
    train.jsonl as pkg:dbm."""
    lib, docs = roots
    with pytest.raises(ValueError, match=r"^--package: 'json' is part of the standard library \(.*\), "
                                         r"already in the corpus$"):
        build_corpus(tmp_path / "out", stdlib_dir=lib, docs_dir=docs, packages=["json"],
                     package_dirs={"json": (lib / "json", "1")})
    assert not (tmp_path / "out").exists()
    # A package under site-packages inside the stdlib folder (pyenv, python.org layouts) is a real package.
    (lib / "site-packages" / "realpkg").mkdir(parents=True, exist_ok=True)
    (lib / "site-packages" / "realpkg" / "core.py").write_text("def g():\n    return 2\n")
    got = collect_files(stdlib_dir=lib, docs_dir=docs, packages={"realpkg": lib / "site-packages" / "realpkg"})
    assert "pkg:realpkg/core.py" in {f.key for f in got}
    corpus_module.resolve_packages(["realpkg"], lib, {"realpkg": (lib / "site-packages" / "realpkg", "1")})


def test_package_never_repeats_a_stdlib_file(roots: tuple[Path, Path], tmp_path: Path) -> None:
    """Safety net behind the refusal: a package file that is a stdlib file (here by symlink) is left out."""
    lib, docs = roots
    pkg = tmp_path / "linkpkg"
    pkg.mkdir()
    (pkg / "decoder.py").symlink_to(lib / "json" / "decoder.py")
    (pkg / "own.py").write_text("def h():\n    return 3\n")
    keys = {f.key for f in collect_files(stdlib_dir=lib, docs_dir=docs, packages={"linkpkg": pkg})}
    assert "pkg:linkpkg/own.py" in keys and "pkg:linkpkg/decoder.py" not in keys


def test_corpus_cli_refuses_stdlib_package(tmp_path: Path) -> None:
    """With the real stdlib: refused before any output is touched."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "train.jsonl").write_bytes(OLD)
    line = _one_error(_cli("corpus", "--package", "dbm", "--out", str(tmp_path / "corpus"),
                           "--tokenizer-out", str(tmp_path / "tok"), "--sft-out", str(tmp_path / "sft")))
    assert line.startswith("error: --package: 'dbm' is part of the standard library (")
    assert _tree(tmp_path) == {"corpus/train.jsonl": OLD}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


BAD_LINES = [
    (b'{"source": "stdlib", "path": "a.py", "text": "caf\xe9"}\n', "not valid UTF-8 (byte 0xe9 at column 50)"),
    (b'{"source": "stdlib", "path": "a.py", "text": \n', "invalid JSON (Expecting value at column 46)"),
    (b'["not", "an", "object"]\n', "not a JSON object"),
]


@pytest.mark.parametrize("bad,problem", BAD_LINES + [
    (b'{"path": "a.py", "text": "x"}\n', "not a corpus record: no string 'source'")])
def test_read_documents_names_file_and_line(tmp_path: Path, bad: bytes, problem: str) -> None:
    path = tmp_path / "heldout.jsonl"
    path.write_bytes(b'{"source": "stdlib", "path": "ok.py", "text": "caf\xc3\xa9"}\n\n' + bad)
    with pytest.raises(DataError) as e:
        list(read_documents(path))
    assert str(e.value) == f"{path}:3: {problem}"
    if "corpus record" not in problem:  # the other JSONL readers (train, eval's SFT data) say the same
        for read in (read_jsonl, read_corpus_jsonl):
            with pytest.raises(DataError) as e:
                list(read(path))
            assert str(e.value) == f"{path}:3: {problem}"


def test_eval_reports_malformed_heldout_in_one_line(family_dirs, tmp_path: Path) -> None:
    """`unmask eval` on a heldout.jsonl with a bad line used to end in a JSONDecodeError/KeyError traceback."""
    for bad, problem in (BAD_LINES[1], (b'{"path": "a.py", "text": "x"}\n', "not a corpus record: no string 'source'")):
        (tmp_path / "heldout.jsonl").write_bytes(b'{"source": "stdlib", "path": "a.py", "text": "x = 1"}\n' + bad)
        line = _one_error(_cli("eval", "-m", str(family_dirs["sdar"]), "--corpus", str(tmp_path),
                               "--sft-heldout", "none", "--limit", "1", "--chat-limit", "0"))
        assert line == f"error: {tmp_path / 'heldout.jsonl'}:2: {problem}"


def test_train_reports_non_utf8_corpus_in_one_line(tok, tmp_path: Path) -> None:
    """`unmask train --data DIR` with invalid UTF-8 in train.jsonl used to end in a UnicodeDecodeError
    traceback with no line number."""
    save_hf_tokenizer(tok, tmp_path / "tok")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_bytes(b'{"text": "x = 1"}\n' + BAD_LINES[0][0])
    line = _one_error(_cli("train", "--data", str(tmp_path / "data"), "--tokenizer", str(tmp_path / "tok"),
                           "--out", str(tmp_path / "run"), "--steps", "1", "--batch-size", "1", "--seq-len", "8"))
    assert line == f"error: {tmp_path / 'data' / 'train.jsonl'}:2: {BAD_LINES[0][1]}"
