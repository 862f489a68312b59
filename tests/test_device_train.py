"""scripts/device_train.py's packaging: a trained model directory -> bf16 shards small enough to bring back
from a device call (+ meta.tar.gz) -> one model.safetensors that loads like the shipped model."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
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
    monkeypatch.setattr(dt, "SHARD_BYTES", 9 * 1024 * 1024)  # the embedding is 8 MiB in bf16
    src = default_model_path()
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "base.log").write_text("step 10/10 loss 3.0\n")
    dt.export_bf16_shards(src, tmp_path / "export")
    fetched = tmp_path / "fetched"
    names = dt.package(tmp_path / "export", logs, fetched)
    assert len(names) >= 2 and all((fetched / n).stat().st_size <= 9 * 1024 * 1024 + 4096 for n in names)
    assert sorted(p.name for p in fetched.iterdir()) == sorted(names + ["meta.tar.gz"])
    dst = tmp_path / "model"
    dt.join_shards(fetched, dst)
    want = {k: v.to(torch.bfloat16) for k, v in load_file(src / "model.safetensors").items()}
    got = load_file(dst / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((dst / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert (dst / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    # the n-gram draft table is a file of the model, not a weight shard: it travels in meta.tar.gz as it is
    assert "ngram_drafts.safetensors" not in names
    assert (dst / "ngram_drafts.safetensors").read_bytes() == (src / "ngram_drafts.safetensors").read_bytes()
    assert not (dst / "model.safetensors.index.json").exists()
    assert (tmp_path / "model.meta" / "logs" / "base.log").read_text().startswith("step 10/10")
    model, spec = load_model(dst, dtype="float32")
    assert model.lm_head.weight.dtype == torch.float32 and spec.arch.hidden_size == 512


def test_a_tensor_over_the_shard_limit_is_refused(tmp_path, monkeypatch):

    dt = _script()
    monkeypatch.setattr(dt, "SHARD_BYTES", 1024 * 1024)
    with pytest.raises(SystemExit, match="embed_tokens.weight: 8,388,608 bytes, more than one shard may hold"):
        dt.export_bf16_shards(default_model_path(), tmp_path / "export")


def test_deadline_plan_gives_each_phase_its_share_of_the_time_left():
    dt = _script()
    # 500 s deadline, 45 s gone, 3 phases left: 500 - 45 - 20 (packaging) - 3 * 15 (start-ups) = 390 s to share
    seconds, steps = dt.plan_steps(500, 45, 3, 0.4, 1.0, 300_000, 64, 512)
    assert seconds == 390 * 0.4 and steps == int(156 * 300_000 / (64 * 512))
    # the last phase gets all that is left; past the deadline it still runs the 20-step floor
    assert dt.plan_steps(500, 400, 1, 0.1, 0.1, 300_000, 64, 512)[0] == 500 - 400 - 20 - 15
    assert dt.plan_steps(500, 499, 1, 0.1, 0.1, 300_000, 64, 512) == (0.0, 20)


def test_steps_must_give_one_count_per_phase(monkeypatch, capsys):

    dt = _script()
    for argv, msg in ((["--steps", "10,20"], "one count per phase: base,adapt,sft"),
                      (["--steps", "10,20,30", "--continue-from", "m"], "adapt,sft with --continue-from"),
                      (["--steps", "10,x,30"], "comma-separated whole numbers"),
                      (["--continue-from", "m"], "--continue-from needs --steps, or --deadline and --rate"),
                      (["--continue-from", "/nonexistent", "--steps", "1,2"], "no config.json there")):
        monkeypatch.setattr("sys.argv", ["device_train.py", *argv])
        with pytest.raises(SystemExit) as e:
            dt.main()
        assert e.value.code == 2 and msg in capsys.readouterr().err


def test_steady_rate_leaves_the_warm_up_out():
    dt = _script()
    log = ("step 10/30 loss 6.8023 lr 8.31e-04 127,422 tok/s eta 00:00:05\n"   # the H200 calibration's lines
           "step 20/30 loss 6.7259 lr 3.55e-04 217,116 tok/s eta 00:00:01\n"
           "step 30/30 loss 6.4608 lr 1.00e-04 283,336 tok/s eta 00:00:00\n")
    rate = dt.steady_rate(log, 64 * 512)
    t20, t30 = 20 * 32768 / 217_116, 30 * 32768 / 283_336
    assert rate == pytest.approx(10 * 32768 / (t30 - t20)) and 720_000 < rate < 730_000  # the base phase ran at 731K
    assert dt.steady_rate(log.splitlines()[0], 32768) is None  # one line: no interval
    assert dt.steady_rate("", 32768) is None


def test_keep_base_brings_the_causal_base_back_beside_the_model(tmp_path):
    """--keep-base: base-*.safetensors shards next to the model's, base/ in meta.tar.gz, --base-to writes it."""
    dt = _script()
    src = default_model_path()
    logs = tmp_path / "logs"
    logs.mkdir()
    dt.export_bf16_shards(src, tmp_path / "export")
    dt.export_bf16_shards(src, tmp_path / "export-base", prefix="base")
    fetched = tmp_path / "fetched"
    names = dt.package(tmp_path / "export", logs, fetched, tmp_path / "export-base")
    assert sorted(n.split("-")[0] for n in names) == ["base"] * 3 + ["model"] * 3
    assert len(list(fetched.iterdir())) == 7  # with summary.json, 8: what one device call brings back
    dt.join_shards(fetched, tmp_path / "model")
    dt.join_shards(fetched, tmp_path / "base", which="base")
    a, b = load_file(tmp_path / "model" / "model.safetensors"), load_file(tmp_path / "base" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "base" / "config.json").is_file()
    dt.package(tmp_path / "export", logs, tmp_path / "no-base")
    with pytest.raises(SystemExit, match="no base/ in meta.tar.gz"):
        dt.join_shards(tmp_path / "no-base", tmp_path / "base2", which="base")
