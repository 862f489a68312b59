"""scripts/device_train.py's packaging: a trained model directory -> bf16 shards small enough to bring back
from a device call (+ meta.tar.gz) -> one model.safetensors that loads like the shipped model."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from unmask.defaults import default_model_path
from unmask.models.loader import load_model

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("device_train", ROOT / "scripts" / "device_train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_shards_round_trip_to_one_bf16_model(tmp_path, monkeypatch):
    dt = _script()
    monkeypatch.setattr(dt, "SHARD_BYTES", 5 * 1024 * 1024)  # the embedding is 4 MiB in bf16
    src = default_model_path()
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "base.log").write_text("step 10/10 loss 3.0\n")
    dt.export_bf16_shards(src, tmp_path / "export")
    fetched = tmp_path / "fetched"
    names = dt.package(tmp_path / "export", logs, fetched)
    assert len(names) >= 2 and all((fetched / n).stat().st_size <= 5 * 1024 * 1024 + 4096 for n in names)
    assert sorted(p.name for p in fetched.iterdir()) == sorted(names + ["meta.tar.gz"])
    dst = tmp_path / "model"
    dt.join_shards(fetched, dst)
    want = {k: v.to(torch.bfloat16) for k, v in load_file(src / "model.safetensors").items()}
    got = load_file(dst / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((dst / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert (dst / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert not (dst / "model.safetensors.index.json").exists()
    assert (tmp_path / "model.meta" / "logs" / "base.log").read_text().startswith("step 10/10")
    model, spec = load_model(dst, dtype="float32")
    assert model.lm_head.weight.dtype == torch.float32 and spec.arch.hidden_size == 256


def test_a_tensor_over_the_shard_limit_is_refused(tmp_path, monkeypatch):
    import pytest

    dt = _script()
    monkeypatch.setattr(dt, "SHARD_BYTES", 1024 * 1024)
    with pytest.raises(SystemExit, match="embed_tokens.weight: 4,194,304 bytes, more than one shard may hold"):
        dt.export_bf16_shards(default_model_path(), tmp_path / "export")
