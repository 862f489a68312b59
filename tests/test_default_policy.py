"""The model's default policy (generation_config.json `default_policy`): a request that names no policy decodes
under it where it can run, and under the threshold rule where it cannot (a grammar, edits, DRY, another policy's
knobs); a model that names none keeps the threshold rule."""
import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from unmask.engine.llm import LLM
from unmask.engine.params import GenerationParams, model_policy
from unmask.errors import InvalidRequestError

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "bench/models/unmask-tiny-5m"
PROMPTS = ["def add(a, b):\n", "import os\n\n\ndef list_files(path):\n", "class Stack:\n    def __init__(self):\n"]
SPECULATIVE_B4 = {"policy": "speculative", "block_size": 4}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("spec-default") / "m"
    shutil.copytree(BASE, out)
    gc_path = out / "generation_config.json"
    gc = json.loads(gc_path.read_text()) if gc_path.is_file() else {}
    gc["default_policy"] = SPECULATIVE_B4
    gc_path.write_text(json.dumps(gc))
    return out


@pytest.fixture(scope="module")
def llm(model_dir):
    torch.manual_seed(0)
    return LLM(model_dir, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def plain():
    return LLM(BASE, dtype="float32", device="cpu")


def run(llm, **knobs):
    return [llm.generate([llm.encode(p)], GenerationParams(max_tokens=24, **knobs))[0] for p in PROMPTS]


def tokens(outs):
    return [o.token_ids for o in outs]


def test_model_policy_reads_the_key_and_ignores_what_is_not_a_policy():
    assert model_policy({"default_policy": SPECULATIVE_B4}) == SPECULATIVE_B4
    assert model_policy({"default_policy": {"policy": "speculative", "block_size": "4", "draft_all_outcomes": 1}}) \
        == {"policy": "speculative"}
    assert model_policy({"default_policy": {"policy": "fastest"}}) is None
    assert model_policy({"default_policy": "speculative"}) is None
    assert model_policy({}) is None


def test_no_policy_named_decodes_under_the_models_default(llm):
    default = run(llm)
    explicit = run(llm, **SPECULATIVE_B4)
    assert tokens(default) == tokens(explicit)
    assert [o.forwards for o in default] == [o.forwards for o in explicit]
    threshold = run(llm, policy="threshold")
    assert tokens(threshold) != tokens(default)  # the two rules differ on this model, so the test can tell


def test_a_request_block_size_wins_over_the_models(llm):
    assert tokens(run(llm, block_size=8)) == tokens(run(llm, policy="speculative", block_size=8))


def test_where_the_default_cannot_run_the_threshold_rule_decodes(llm):
    from unmask.structured.spec import StructuredSpec

    for knobs in (dict(threshold=0.7), dict(steps=4), dict(edit_threshold=0.9),
                  dict(multi_block_threshold=0.5)):
        assert tokens(run(llm, **knobs)) == tokens(run(llm, policy="threshold", **knobs)), knobs
    # a grammar-constrained request is served by the default since 2026-12-06 (tests/test_speculative_structured.py)
    spec = StructuredSpec("choice", ("yes", "no"))
    out = run(llm, structured=spec)
    assert {o.text for o in out} <= {"yes", "no"}
    assert tokens(out) == tokens(run(llm, structured=spec, **SPECULATIVE_B4))
    # named explicitly, the same combinations are refused, as before
    with pytest.raises(InvalidRequestError, match="cannot be combined with small_block_size"):
        run(llm, policy="speculative", small_block_size=2)
    # DRY is served by the default since 2026-12-06 (tests/test_speculative.py, penalties)
    assert tokens(run(llm, dry_multiplier=0.8)) == tokens(run(llm, dry_multiplier=0.8, **SPECULATIVE_B4))


def test_a_model_without_a_default_keeps_the_threshold_rule(plain):
    assert tokens(run(plain)) == tokens(run(plain, policy="threshold"))


def test_over_http_a_request_without_policy_takes_the_default(model_dir, tmp_path):
    from fastapi.testclient import TestClient

    from unmask.server.app import ServerArgs, create_app

    args = ServerArgs(model=model_dir, served_model_name="m", dtype="float32", data_dir=tmp_path)
    with TestClient(create_app(args)) as http:  # the lifespan loads the model in a thread
        for _ in range(600):
            if http.get("/health").status_code == 200:
                break
            time.sleep(0.1)
        check_http(http)


def check_http(http):
    body = {"model": "m", "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0}
    default = http.post("/v1/completions", json=body)
    explicit = http.post("/v1/completions", json={**body, **SPECULATIVE_B4})
    assert default.status_code == explicit.status_code == 200, default.text
    assert default.json()["choices"][0]["text"] == explicit.json()["choices"][0]["text"]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    chat = http.post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "ok?"}], "max_tokens": 24,
        "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}}})
    assert chat.status_code == 200, chat.text
    assert isinstance(json.loads(chat.json()["choices"][0]["message"]["content"])["ok"], bool)
