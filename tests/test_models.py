"""Every family: loads from its real on-disk format and matches an independent dense reference."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from reference_forward import reference_logits
from unmask.errors import ModelLoadError, UnsupportedModelError
from unmask.models.attention import AttentionBatch, Segment
from unmask.models.loader import load_model

FAMILY_NAMES = ["llada", "dream", "sdar", "fast_dllm_v2", "llada2"]


def our_logits(model, spec, ids: torch.Tensor, block_size: int | None) -> torch.Tensor:
    L = ids.numel()
    pos = torch.arange(L)
    seg = Segment(start=0, length=L, block_ids=None if block_size is None else pos // block_size)
    with torch.inference_mode():
        hidden = model(ids, pos, AttentionBatch([seg]).prepare())
        return model.logits(hidden)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_logits_match_reference(family, family_dirs):
    model, spec = load_model(family_dirs[family])
    assert spec.family.name == family
    ids = torch.randint(0, 400, (19,), generator=torch.Generator().manual_seed(1))
    if spec.family.attention == "bidirectional":
        ours = our_logits(model, spec, ids, None)
        ref = reference_logits(family_dirs[family], ids[None], "bidirectional")[0]
    else:
        B = 4
        ours = our_logits(model, spec, ids, B)
        ref = reference_logits(family_dirs[family], ids[None], f"block_causal:{B}")[0]
    assert ours.shape == ref.shape == (19, spec.arch.vocab_size)
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["sdar", "llada2", "fast_dllm_v2"])
def test_block_causal_mask_hides_later_blocks(family, family_dirs):
    model, spec = load_model(family_dirs[family])
    a = torch.randint(0, 400, (12,), generator=torch.Generator().manual_seed(2))
    b = a.clone()
    b[8:] = (b[8:] + 7) % 400  # change only the third block of 4
    la, lb = our_logits(model, spec, a, 4), our_logits(model, spec, b, 4)
    # MoE experts batch different row sets when other tokens change: equal up to float rounding
    assert (la[:8] - lb[:8]).abs().max() < 1e-5
    assert (la[8:] - lb[8:]).abs().max() > 1e-3


def test_bidirectional_sees_later_tokens(family_dirs):
    model, spec = load_model(family_dirs["llada"])
    a = torch.randint(0, 400, (12,), generator=torch.Generator().manual_seed(3))
    b = a.clone()
    b[-1] = (b[-1] + 1) % 400
    assert (our_logits(model, spec, a, None)[0] - our_logits(model, spec, b, None)[0]).abs().max() > 1e-5


def test_sharded_checkpoint_loads_identically(family_dirs, tmp_path):
    from tiny_checkpoints import FAMILIES

    sharded = FAMILIES["sdar"](tmp_path / "sharded", sharded=True)
    assert (sharded / "model.safetensors.index.json").is_file()
    m1, s1 = load_model(family_dirs["sdar"])
    m2, _ = load_model(sharded)
    ids = torch.arange(10, 22)
    assert torch.equal(our_logits(m1, s1, ids, 4), our_logits(m2, s1, ids, 4))


def test_bfloat16_load(family_dirs):
    model, spec = load_model(family_dirs["sdar"], dtype="bfloat16")
    assert model.lm_head.weight.dtype == torch.bfloat16
    ref, _ = load_model(family_dirs["sdar"])
    ids = torch.arange(10, 22)
    diff = (our_logits(model, spec, ids, 4) - our_logits(ref, spec, ids, 4)).abs().max()
    assert 0 < diff < 0.1


def test_default_dtype_follows_native_bf16(monkeypatch):
    import unmask.models.loader as loader

    monkeypatch.delenv("UNMASK_DTYPE", raising=False)
    for native, expect in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(loader, "bf16_is_fast", lambda device, v=native: v)
        assert loader.resolve_dtype(None, "cpu") is expect
        assert loader.resolve_dtype("auto", "cpu") is expect
        assert loader.resolve_dtype("float32", "cpu") is torch.float32  # explicit wins
        assert loader.resolve_dtype(torch.float16, "cpu") is torch.float16
    monkeypatch.setenv("UNMASK_DTYPE", "bfloat16")  # the variable beats auto, an argument beats the variable
    assert loader.resolve_dtype(None, "cpu") is torch.bfloat16
    assert loader.resolve_dtype("float32", "cpu") is torch.float32
    assert [loader.dtype_name(loader.resolve_dtype(n, "cpu")) for n in loader.DTYPES] == list(loader.DTYPES)
    monkeypatch.setenv("UNMASK_DTYPE", "fp8")
    with pytest.raises(ModelLoadError, match=r"unknown dtype 'fp8'; choose one of auto, float32, bfloat16, float16"):
        loader.resolve_dtype(None, "cpu")


# ---------------------------------------------------------------- bad checkpoints

def copy_dir(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_directory_and_hub_id():
    with pytest.raises(ModelLoadError, match="not found.*never downloads"):
        load_model("GSAI-ML/LLaDA-8B-Instruct")


def test_unknown_architecture(family_dirs, tmp_path):
    d = copy_dir(family_dirs["sdar"], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="unsupported architecture GPT2LMHeadModel; supported: .*LLaDAModelLM"):
        load_model(d)


def test_corrupt_weights(family_dirs, tmp_path):
    d = copy_dir(family_dirs["sdar"], tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ModelLoadError, match="cannot read weights model.safetensors"):
        load_model(d)


def test_missing_weight_and_shape_mismatch(family_dirs, tmp_path):
    d = copy_dir(family_dirs["sdar"], tmp_path / "m")
    state = load_file(str(d / "model.safetensors"))
    name = "model.layers.0.self_attn.q_norm.weight"
    del state[name]
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=f"missing weights {name}"):
        load_model(d)
    state[name] = torch.ones(3)
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=rf"weight {name} has shape \(3,\), config implies"):
        load_model(d)


def test_missing_shard(family_dirs, tmp_path):
    from tiny_checkpoints import FAMILIES

    d = FAMILIES["sdar"](tmp_path / "sharded", sharded=True)
    next(d.glob("model-0000*-of-*.safetensors")).unlink()
    with pytest.raises(ModelLoadError, match="shard.*missing"):
        load_model(d)
