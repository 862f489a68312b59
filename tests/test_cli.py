"""CLI: prints text, stats, and one-line errors with a non-zero exit."""
import pytest
from typer.testing import CliRunner

from unmask.cli import app

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, list(args))


def test_generate_prints_prompt_and_continuation(family_dirs):
    r = invoke("generate", "--model", str(family_dirs["sdar"]), "--max-tokens", "8", "--block-size", "4",
               "--stats", "hello world")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("hello world")
    assert "tokens/forward" in r.stderr and "forwards" in r.stderr


def test_generate_is_deterministic_with_seed(family_dirs):
    args = ("generate", "--model", str(family_dirs["sdar"]), "--max-tokens", "8", "--temperature", "1.0",
            "--seed", "3", "hi")
    assert invoke(*args).stdout == invoke(*args).stdout


def test_generate_takes_penalties(family_dirs, monkeypatch):
    """The flags reach GenerationParams (the arithmetic is tested in test_logit_adjust.py)."""
    from unmask.engine import llm as llm_module

    seen = []
    original = llm_module.LLM.generate
    monkeypatch.setattr(llm_module.LLM, "generate", lambda self, ids, p: seen.append(p) or original(self, ids, p))
    r = invoke("generate", "--model", str(family_dirs["sdar"]), "--max-tokens", "8", "--block-size", "4",
               "--frequency-penalty", "0.5", "--presence-penalty", "1.5", "hi")
    assert r.exit_code == 0 and r.stdout.startswith("hi")
    assert (seen[0].frequency_penalty, seen[0].presence_penalty) == (0.5, 1.5)
    # the built-in model recommends a frequency penalty in its generation_config; a flag overrides it
    assert invoke("generate", "--max-tokens", "4", "hi").exit_code == 0
    assert (seen[1].frequency_penalty, seen[1].presence_penalty) == (0.5, 0.0)
    assert invoke("generate", "--max-tokens", "4", "--frequency-penalty", "0", "hi").exit_code == 0
    assert seen[2].frequency_penalty == 0.0


@pytest.mark.parametrize("args, message", [
    (("--model", "/no/such/dir"), "error: model directory '/no/such/dir' not found"),
    (("--policy", "bogus"), "error: name: unknown decoding policy 'bogus'"),
    (("--max-tokens", "0"), "error: max_tokens must be a positive integer"),
    (("--threshold", "1.5"), "error: threshold must be in (0, 1]"),
    (("--max-tokens", "5000"), "over this model's context of 4096"),
    (("--presence-penalty", "3"), "error: presence_penalty must be in [-2, 2], got 3.0"),
])
def test_bad_input_is_one_line(family_dirs, args, message):
    base = [] if "--model" in args else ["--model", str(family_dirs["sdar"])]
    r = invoke("generate", *base, *args, "hi")
    assert r.exit_code == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr
