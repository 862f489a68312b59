"""Structured output under the `speculative` policy: each verifier row is masked as constrained next-token decoding
masks it there (Constraint.chain_masks), forced text is committed without a forward, and so the drafts change the
number of forwards, never the output. On the committed, trained 5.25M model and the built-in one (whose default
policy now serves grammar-constrained requests too)."""
import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from unmask.engine.llm import LLM
from unmask.engine.params import GenerationParams
from unmask.errors import InvalidRequestError
from unmask.structured.spec import StructuredSpec

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "bench/models/unmask-tiny-5m"
NO_DRAFTS = dict(policy="speculative", block_size=1, draft_lookup=0)  # a draft block of 1 drafts nothing
DRAFTS = dict(policy="speculative", block_size=4, draft_lookup=8)
NEXT_TOKEN = dict(policy="topk", tokens_per_step=1, block_size=1)
SCHEMA = {"type": "object", "properties": {"function": {"type": "string"}, "summary": {"type": "string"},
                                           "lines": {"type": "integer"}},
          "required": ["function", "summary", "lines"], "additionalProperties": False}
REGEX = r"def [a-z_]+\([a-z, ]*\):\n    return [a-z_.()]+"
SPECS = [StructuredSpec("json", SCHEMA, "response_format", True), StructuredSpec("json", {"type": "object"}),
         StructuredSpec("regex", REGEX, "regex"), StructuredSpec("choice", ("positive", "negative", "neutral")),
         StructuredSpec("grammar", 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,3}/', "grammar")]
PROMPTS = ["import os\n\ndef join_paths(a, b):\n    return os.path.join(a, b)\n\n# join_paths as JSON:\n",
           "def add(a, b):\n    return a + b\n\n",
           "User: write a function that doubles a number\nAssistant:"]


@pytest.fixture(scope="module")
def llm():
    torch.manual_seed(0)
    return LLM(MODEL, dtype="float32", device="cpu")


def run(llm, spec, prompt, max_tokens=96, **knobs):
    return llm.generate([llm.encode(prompt)], GenerationParams(max_tokens=max_tokens, structured=spec, **knobs))[0]


def valid(spec, text: str) -> bool:
    if spec.kind == "json":
        jsonschema.validate(json.loads(text), spec.value)
        return True
    if spec.kind == "regex":
        return re.fullmatch(spec.value, text) is not None
    if spec.kind == "choice":
        return text in spec.value
    return re.fullmatch(r"\(\d{1,3}(\+\d{1,3})*\)", text) is not None


@pytest.mark.parametrize("all_outcomes", [False, True])
def test_drafts_change_the_forwards_not_the_output(llm, all_outcomes):
    forwards = {"drafts": 0, "none": 0, "threshold": 0}
    tokens = 0
    for spec in SPECS:
        for prompt in PROMPTS:
            ref = run(llm, spec, prompt, **NO_DRAFTS)
            got = run(llm, spec, prompt, **DRAFTS, draft_all_outcomes=all_outcomes)
            assert got.token_ids == ref.token_ids, (spec.kind, prompt)
            assert got.finish_reason == ref.finish_reason
            if got.finish_reason == "stop":
                assert valid(spec, got.text), (spec.kind, got.text)
            forwards["drafts"] += got.forwards
            forwards["none"] += ref.forwards
            forwards["threshold"] += run(llm, spec, prompt, policy="threshold", threshold=0.9).forwards
            tokens += len(got.token_ids)
    # when written: 563 tokens in 160 forwards with drafts, 506 without; the threshold rule 487 tokens in 401
    assert forwards["drafts"] * 1.5 < forwards["none"] and forwards["drafts"] * 1.5 < forwards["threshold"], forwards
    assert tokens / forwards["drafts"] > 2.0, (tokens, forwards)


def test_it_writes_constrained_next_token_decoding(llm):
    """The verifier's tokens are those of one-token-per-forward decoding under the same grammar, with the forced
    text between them: every answer that ends by itself, and the start of those the budget closes (within its
    last CLOSE_WINDOW positions each decoder closes at its own pace: the forced text comes in runs of different
    lengths)."""
    from unmask.structured.constraint import CLOSE_WINDOW

    ended = 0
    for spec in SPECS:
        for prompt in PROMPTS:
            ref, got = run(llm, spec, prompt, max_tokens=200, **NEXT_TOKEN), run(llm, spec, prompt, max_tokens=200,
                                                                                   **DRAFTS)
            assert got.forwards < ref.forwards
            if ref.finish_reason == "stop":
                assert got.token_ids == ref.token_ids and got.finish_reason == "stop"
                ended += 1
            else:
                assert got.token_ids[:200 - CLOSE_WINDOW] == ref.token_ids[:200 - CLOSE_WINDOW]
    assert ended >= 10


def test_budget_closes_the_answer_in_time(llm):
    spec = SPECS[0]   # its shortest answer is 18 tokens; this prompt makes the model ramble in the first string
    for max_tokens in (20, 24, 40):
        got = run(llm, spec, PROMPTS[2], max_tokens=max_tokens, **DRAFTS)
        assert len(got.token_ids) <= max_tokens and got.finish_reason == "length"
        jsonschema.validate(json.loads(got.text), SCHEMA)


def test_sampling_stays_in_the_language_and_follows_the_seed(llm):
    spec = SPECS[0]
    texts = []
    for seed in range(4):
        knobs = dict(DRAFTS, temperature=1.0, seed=seed)
        a, b = run(llm, spec, PROMPTS[0], **knobs), run(llm, spec, PROMPTS[0], **knobs)
        assert a.token_ids == b.token_ids
        if a.finish_reason == "stop":
            jsonschema.validate(json.loads(a.text), SCHEMA)
        texts.append(a.text)
    assert len(set(texts)) > 1


def test_logprobs_of_forced_text_are_zero(llm):
    spec = SPECS[0]
    got = run(llm, spec, PROMPTS[1], logprobs=True, top_logprobs=2, **DRAFTS)
    lps = got.logprobs
    assert len(lps) == len(got.token_ids)
    opening = llm.encode('{"')
    assert got.token_ids[:len(opening)] == opening and all(lp == 0.0 for lp in lps[:len(opening)])
    assert any(lp < 0.0 for lp in lps) and all(lp <= 0.0 for lp in lps)


def test_a_check_that_never_passes_is_a_400_after_bounded_attempts(llm):
    """The after-draft check's further attempts (sampled, the prompt's K/V kept) run under the policy too."""
    from unmask.structured.constraint import ATTEMPTS

    spec = StructuredSpec.json_schema({"type": "integer", "not": {"type": "integer"}})
    seq = llm.engine.add_request(llm.encode(PROMPTS[1]), GenerationParams(max_tokens=16, structured=spec, seed=0,
                                                                          **DRAFTS))
    llm.engine.run_to_completion()
    assert seq.constraint.attempts == ATTEMPTS and isinstance(seq.error, InvalidRequestError)
    assert "after-draft" in str(seq.error)


def test_the_built_in_default_serves_structured_requests_speculatively():
    from unmask.defaults import default_model_path

    llm = LLM(default_model_path(), dtype="float32", device="cpu")
    spec = SPECS[0]
    params = llm.engine.resolve_policy(GenerationParams(max_tokens=64, structured=spec))
    assert params.policy == "speculative"
    got = run(llm, spec, PROMPTS[2], max_tokens=64)
    assert got.token_ids == run(llm, spec, PROMPTS[2], max_tokens=64, **NO_DRAFTS).token_ids
    jsonschema.validate(json.loads(got.text), SCHEMA)
