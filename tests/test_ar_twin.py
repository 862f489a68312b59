"""The AR twin branches from the diffusion model's causal base: same weights, same function."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from unmask.models.transformer import CAUSAL
from unmask.train.checkpoint import export_model
from unmask.train.model_init import fresh_model, init_weights, new_unmask_config

ROOT = Path(__file__).resolve().parents[1]


def _twin_script():
    spec = importlib.util.spec_from_file_location("train_ar_twin", ROOT / "scripts" / "train_ar_twin.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _base(out: Path, causal: bool = True) -> tuple[Path, torch.nn.Module]:
    cfg = new_unmask_config(96, 32, 2, 4, 2, 8, 64, 256, 4, mask_id=3, eos_ids=[2], bos_id=1, pad_id=0,
                            tie_embeddings=True)
    if causal:
        cfg["shift_logits"] = True
    tm = fresh_model(cfg, {"eos_token_id": [2]}, seed=0)
    init_weights(tm.model, 0, std=0.2)
    return export_model(tm, out, None), tm.model


def test_twin_loaded_from_the_causal_base_computes_the_same_logits(tmp_path):
    twin_mod = _twin_script()
    base_dir, base = _base(tmp_path / "base")
    shape, ref_config, _ = twin_mod.shape_from(base_dir)
    twin = twin_mod.build_twin(shape, ref_config, seed=1).float().eval()
    twin_mod.load_base(twin, base_dir)
    ids = torch.randint(16, 90, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = base.logits(base.forward_dense(ids, torch.arange(24).expand(2, 24), CAUSAL))
        got = twin(input_ids=ids).logits.float()
    assert (got - want).abs().max().item() <= 1e-4


def test_twin_refuses_a_base_that_is_not_causal(tmp_path):
    twin_mod = _twin_script()
    base_dir, _ = _base(tmp_path / "diffusion", causal=False)
    shape, ref_config, _ = twin_mod.shape_from(base_dir)
    twin = twin_mod.build_twin(shape, ref_config, seed=1)
    with pytest.raises(SystemExit, match="not a causal base"):
        twin_mod.load_base(twin, base_dir)
    assert "shift_logits" not in json.loads((base_dir / "config.json").read_text())


def test_twin_info_finds_the_budget_in_the_run_or_the_committed_copy(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    from benchlib.twin import twin_info

    run = tmp_path / "run"
    model = run / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    assert "budget_detail" not in twin_info(model)
    (run / "budget.json").write_text(json.dumps({"budget": "flops", "where": "run"}))
    assert twin_info(model)["budget_detail"]["where"] == "run"
    (model / "budget.json").write_text(json.dumps({"budget": "flops", "where": "model"}))  # as `make twin` copies it
    info = twin_info(model)
    assert info["budget_detail"]["where"] == "model" and info["architecture"] == "Qwen3ForCausalLM"


def test_budget_counts_the_next_token_rows_of_a_causal_context_reference():
    """A reference trained with the clean rows' next-token loss spent 6 * D * V FLOPs more per eligible token
    (those rows' LM head, forward and backward); the twin's steps grow by exactly that share."""
    twin_mod = _twin_script()
    shape = twin_mod.Shape(8192, 256, 4, 8, 4, 32, 768, 2048, 1e4, 1e-6, True)
    plain = twin_mod.diffusion_flops_per_row(shape, 512, 512.0)
    with_next = twin_mod.diffusion_flops_per_row(shape, 512, 512.0, next_token=True)
    assert with_next - plain == 6 * 256 * 8192 * 512
    assert plain == 35433480192.0  # the committed bench/models/ar-twin/budget.json's figure for this shape
    a = twin_mod.Phase("pretrain", 700, 30, 1e-3, 16, 512, eligible=512.0)
    b = twin_mod.Phase("pretrain", 700, 30, 1e-3, 16, 512, eligible=512.0, next_token=True)
    a.plan(shape, "flops")
    b.plan(shape, "flops")
    assert a.steps == 1400 and b.steps == round(1400 * with_next / plain)


def test_twin_continues_from_an_earlier_twin_stage(tmp_path):
    """`--init-from OUT/pretrain/model` (a Qwen3ForCausalLM the script exported) loads unchanged."""
    twin_mod = _twin_script()
    base_dir, _ = _base(tmp_path / "base")
    shape, ref_config, _ = twin_mod.shape_from(base_dir)
    stage = twin_mod.build_twin(shape, ref_config, seed=1).float().eval()
    stage.save_pretrained(tmp_path / "stage", safe_serialization=True)
    again = twin_mod.build_twin(shape, ref_config, seed=2).float().eval()
    twin_mod.load_base(again, tmp_path / "stage")
    ids = torch.randint(16, 90, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, stage(input_ids=ids).logits)


def test_pretrain_stages_mirror_each_diffusion_run():
    twin_mod = _twin_script()
    assert twin_mod.pretrain_stages("592,600", "30", "1e-3,5e-4") == [
        ("pretrain", 592, 30, 1e-3), ("pretrain2", 600, 30, 5e-4)]
    assert twin_mod.pretrain_stages("592", "30", "1e-3") == [("pretrain", 592, 30, 1e-3)]
    with pytest.raises(SystemExit, match=r"--ref-pretrain-lr: 3 values for 2 stages"):
        twin_mod.pretrain_stages("592,600", "30", "1e-3,5e-4,1")
    with pytest.raises(SystemExit, match=r"--ref-pretrain-steps: expected comma-separated numbers, got '592,x'"):
        twin_mod.pretrain_stages("592,x", "30", "1e-3")


def test_an_unknown_device_is_one_line_before_any_work(tmp_path):
    import subprocess

    r = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "scripts" / "train_ar_twin.py"),
                        "--quick", "--out", str(tmp_path / "twin"), "--device", "tpu"], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip() == "error: unknown device 'tpu'; use auto, cpu or cuda[:N]"
    assert not (tmp_path / "twin").exists()


@pytest.mark.parametrize("loop", ["generate", "loop", "lookup"])
def test_twin_decoders_stop_at_the_newline_after_the_lead(loop):
    """A next-line answer opens with its newline (the lead, min_tokens=1) and ends at the next one, as the engine's
    stop "\\n" with min_tokens=1 ends it: the twin generates the same answer, not 48 tokens past it. With prompt
    lookup several tokens may be accepted at once: the answer is still cut after that newline."""
    sys.path.insert(0, str(ROOT / "bench"))   # alone (-k) too, not only after the test that adds it
    from benchlib.twin import HFTwin, HFTwinLookup, HFTwinLoop

    hf = HFTwin(ROOT / "bench" / "models" / "ar-twin")
    dec = hf if loop == "generate" else HFTwinLoop.sharing(hf) if loop == "loop" else HFTwinLookup.sharing(hf, 8)
    ids = hf.tok.encode("def add(a, b):")
    lead_only = dec.run(ids, 24, stop_newline=True, min_tokens=0)
    assert lead_only.tokens == 1 and lead_only.text.startswith("\n")
    line = dec.run(ids, 24, stop_newline=True, min_tokens=1)
    free = dec.run(ids, 24, stop_newline=False)
    assert 1 < line.tokens < free.tokens == 24
    assert free.text.startswith(line.text)
    # it ends with the token holding the first newline after the lead (this tokenizer's newline tokens are
    # newline + indentation)
    end_of_line = line.text.index("\n", len(lead_only.text))
    assert line.text[end_of_line:].strip() == ""
    if loop == "lookup":   # greedy prompt lookup is lossless: the plain twin's answers
        assert (line.text, free.text) == (hf.run(ids, 24, True, 1).text, hf.run(ids, 24, False).text)
