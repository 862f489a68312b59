"""The AR twin written as an unmask checkpoint (scripts/ar_twin_as_unmask.py): the engine's next-token decoding of it
writes the twin's own greedy text, so it can start an AR-initialised distillation."""
from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TWIN, REFERENCE = ROOT / "bench/models/ar-twin", ROOT / "bench/models/unmask-tiny-5m"


def _script():
    spec = importlib.util.spec_from_file_location("ar_twin_as_unmask", ROOT / "scripts" / "ar_twin_as_unmask.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not (TWIN / "model.safetensors").is_file(), reason="no committed AR twin")
def test_engine_writes_the_twins_greedy_text(tmp_path):
    from transformers import AutoModelForCausalLM

    from unmask.engine.llm import LLM
    from unmask.engine.params import GenerationParams
    from unmask.evaluation import POLICIES

    out = _script().convert(TWIN, REFERENCE, tmp_path / "twin")
    llm = LLM(out, dtype="float32", device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(str(TWIN), dtype=torch.float32).eval()
    prompts = ["def read_config(path):\n    with open(path) as f:\n", "import os\nimport sys\n\n\nclass ",
               "    for i in range(len(items)):\n        if items[i] ", "# Copyright (c) the authors\n\"\"\""]
    for text in prompts:
        ids = llm.encode(text)
        got = llm.generate([ids], [GenerationParams(max_tokens=16, **POLICIES["next_token_greedy"])])[0].token_ids
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=[2, 5, 13],
                               pad_token_id=0)[0, len(ids):].tolist()
        assert len(got) >= 1 and got == want[:len(got)], text


def test_refuses_another_tokenizer_or_shape(tmp_path):
    from safetensors.torch import save_file

    mod = _script()
    ref, twin = tmp_path / "ref", tmp_path / "twin"
    ref.mkdir(), twin.mkdir()
    (ref / "tokenizer.json").write_text('{"a": 1}')
    (ref / "config.json").write_text(json.dumps({"causal_context": True, "shift_logits": True}))
    save_file({"w": torch.zeros(4, 8)}, str(ref / "model.safetensors"))
    (twin / "tokenizer.json").write_text('{"a": 2}')
    save_file({"w": torch.zeros(4, 8)}, str(twin / "model.safetensors"))
    with pytest.raises(ValueError, match="numbers tokens differently"):
        mod.convert(twin, ref, tmp_path / "out")
    shutil.copyfile(ref / "tokenizer.json", twin / "tokenizer.json")
    save_file({"w": torch.zeros(4, 16)}, str(twin / "model.safetensors"))
    with pytest.raises(ValueError, match=r"differ in parameter w"):
        mod.convert(twin, ref, tmp_path / "out")
    save_file({"w": torch.ones(4, 8)}, str(twin / "model.safetensors"))
    out = mod.convert(twin, ref, tmp_path / "out")
    from safetensors.torch import load_file
    assert torch.equal(load_file(str(out / "model.safetensors"))["w"], torch.ones(4, 8))
    assert json.loads((out / "config.json").read_text())["causal_context"] is True
    (ref / "config.json").write_text(json.dumps({"shift_logits": True}))
    with pytest.raises(ValueError, match="not a causal-context model"):
        mod.convert(twin, ref, tmp_path / "out2")


FROM_TWIN = ROOT / "bench/models/unmask-tiny-5m-from-twin"


@pytest.mark.skipif(not (FROM_TWIN / "model.safetensors").is_file(), reason="no committed model from the twin")
def test_committed_model_from_the_twin_decodes_its_next_token_text_by_default():
    """The committed distillation loads with its n-gram table, defaults to `speculative`, and that default writes
    exactly its one-token-per-forward next-token decoding, in fewer forwards."""
    from unmask.engine.llm import LLM
    from unmask.engine.params import GenerationParams
    from unmask.evaluation import POLICIES

    cfg = json.loads((FROM_TWIN / "generation_config.json").read_text())
    assert cfg["default_policy"] == {"policy": "speculative", "block_size": 4, "draft_lookup": 8}
    llm = LLM(FROM_TWIN, dtype="float32", device="cpu")
    prompts = [llm.encode(t) for t in ("def read_config(path):\n    with open(path) as f:\n",
                                       "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(")]
    greedy = llm.generate(prompts, [GenerationParams(max_tokens=32, **POLICIES["next_token_greedy"])] * 2)
    spec = llm.generate(prompts, [GenerationParams(max_tokens=32, **POLICIES["speculative_b4_lookup"])] * 2)
    for g, s in zip(greedy, spec):
        assert s.token_ids == g.token_ids
    assert sum(s.decoding_forwards for s in spec) < sum(g.decoding_forwards for g in greedy)
