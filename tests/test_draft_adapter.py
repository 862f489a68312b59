"""The draft adapter (models/draft_adapter.py): low-rank weights on masked rows only. Clean rows stay the base's
bit for bit, so speculative decoding writes the base's next-token decoding; distillation trains the adapter alone
and exports a model that loads everywhere the base did."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from test_distill import TRAJ, _cfg, base, chat_file, corpus  # noqa: F401 (fixtures)
from test_speculative import AR, MODEL, code_prompts, one_by_one
from test_train import _cli, _one_line_error, tokdir  # noqa: F401 (tokdir: a fixture)
from unmask.errors import ModelLoadError
from unmask.models.draft_adapter import DraftAdapterConfig
from unmask.models.loader import load_model
from unmask.train.distill import distill
from unmask.train.model_init import apply_draft_adapter, load_trainable


def _with_random_adapter(src: Path, out: Path, rank: int = 4) -> Path:
    """`src` with a draft adapter whose B is not zero (an untrained one would change nothing), exported."""
    from unmask.train.checkpoint import export_model

    tm = load_trainable(src)
    apply_draft_adapter(tm, rank)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in tm.model.named_parameters():
            if name.endswith(".draft_b"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return export_model(tm, out, None)


def test_clean_rows_are_the_base_bit_for_bit_and_masked_rows_change(tmp_path):
    adapted_dir = _with_random_adapter(MODEL, tmp_path / "adapted")
    base, spec = load_model(MODEL, dtype="float32")
    adapted, aspec = load_model(adapted_dir, dtype="float32")
    assert base.draft_gate is None and adapted.draft_gate is not None
    assert aspec.arch.draft_adapter == DraftAdapterConfig(4, 8.0, spec.mask_id)
    ids = torch.randint(20, 500, (2, 24))
    ids[:, 16:] = spec.mask_id  # a committed prefix, then a block of masks
    pos = torch.arange(24).expand(2, 24)
    mask = torch.ones(24, 24, dtype=torch.bool).tril()
    mask[16:, 16:] = True
    with torch.no_grad():
        a = base.forward_dense(ids, pos, mask[None, None])
        b = adapted.forward_dense(ids, pos, mask[None, None])
    assert torch.equal(a[:, :16], b[:, :16])
    assert (a[:, 16:] - b[:, 16:]).abs().max() > 1e-3
    # inference on the CPU gathers the draft rows; training (and CUDA) selects with `where`: the same numbers
    trained = adapted.forward_dense(ids, pos, mask[None, None]).detach()
    assert torch.equal(trained[:, :16], a[:, :16])
    assert torch.allclose(trained[:, 16:], b[:, 16:], atol=1e-5)


def test_speculative_output_with_an_adapter_is_the_base_next_token_decoding(tmp_path):
    from unmask.engine.llm import LLM

    adapted = LLM(_with_random_adapter(MODEL, tmp_path / "adapted"), dtype="float32", device="cpu")
    base = LLM(MODEL, dtype="float32", device="cpu")
    prompts = [base.encode(p) for p in code_prompts()]
    ref = one_by_one(base, prompts, **AR)
    for knobs in (dict(), dict(draft_lookup=8, block_size=4), dict(draft_all_outcomes=True, block_size=4)):
        got = one_by_one(adapted, prompts, policy="speculative", **knobs)
        assert [o.token_ids for o in got] == [o.token_ids for o in ref], knobs
    # the drafts differ from the base's (so do the forwards they take), the output does not
    plain = one_by_one(base, prompts, policy="speculative")
    assert [o.forwards for o in one_by_one(adapted, prompts, policy="speculative")] != [o.forwards for o in plain]


def test_distilling_a_draft_adapter_trains_it_alone_and_exports_a_loadable_model(tmp_path, base, corpus):
    res = distill(_cfg(tmp_path / "run", draft_adapter_rank=4), base, TRAJ, text=corpus)
    cfg = json.loads((res.model_dir / "config.json").read_text())
    assert cfg["draft_adapter"]["rank"] == 4 and cfg["draft_adapter"]["alpha"] == 8.0
    before, after = load_file(str(Path(base) / "model.safetensors")), load_file(str(res.model_dir / "model.safetensors"))
    adapter = sorted(k for k in after if k.endswith((".draft_a", ".draft_b")))
    assert len(adapter) == 2 * 7 * len({k.split(".")[2] for k in adapter})  # 7 linears a layer, A and B each
    assert sorted(set(after) - set(adapter)) == sorted(before)
    assert all(torch.equal(before[k], after[k]) for k in before)  # the base did not move
    assert any(after[k].abs().max() > 0 for k in adapter if k.endswith(".draft_b"))  # the adapter did
    report = json.loads((tmp_path / "run" / "distill.json").read_text())
    assert report["student"]["draft_adapter_rank"] == 4
    loaded, _ = load_model(res.model_dir, dtype="float32")
    assert loaded.draft_gate is not None


# resuming a draft-adapter run exactly: tests/test_distill.py, test_resume_reuses_the_cache_and_continues_exactly


def test_draft_adapter_and_lora_together_are_refused(tmp_path):
    from unmask.train.trainer import TrainConfigError

    with pytest.raises(TrainConfigError, match="draft_adapter_rank and lora_rank both choose"):
        _cfg(tmp_path / "x", draft_adapter_rank=4, lora_rank=4)


@pytest.mark.parametrize("entry,message", [
    ("yes", "draft_adapter must be an object"),
    ({"rank": 0, "alpha": 8, "mask_token_id": 3}, "rank must be a positive integer, got 0"),
    ({"rank": 4, "alpha": -1, "mask_token_id": 3}, "alpha must be a positive number, got -1"),
    ({"rank": 4, "alpha": 8}, "mask_token_id must be a token id, got None"),
    ({"rank": 4, "alpha": 8, "mask_token_id": 3, "target_modules": ["lm_head"]}, "unknown lm_head"),
])
def test_a_malformed_config_entry_is_a_clear_load_error(tmp_path, entry, message):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(MODEL, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "draft_adapter": entry}))
    with pytest.raises(ModelLoadError, match=message):
        load_model(d, dtype="float32")


@pytest.mark.parametrize("command", ["distill", "finetune"])
def test_cli_distill_and_finetune_pass_draft_adapter_on(tmp_path, base, corpus, chat_file, command):
    data = ["--text", corpus, "--prompts", "4", "--answer-tokens", "4"] if command == "distill" else ["--data", chat_file]
    r = _cli(command, "-m", base, *data, "--out", tmp_path / "d", "--steps", "1", "--batch-size", "2", "--seq-len",
             "64", "--draft-adapter", "4", "--lora-rank", "4")
    _one_line_error(r, "draft_adapter_rank and lora_rank both choose")  # reached the config: the option is wired
