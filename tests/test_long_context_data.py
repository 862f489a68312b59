"""Long-context training data (issue 34, item 1; unmask.train.long_context): files joined per package, passkey
rows of an exact length with the loss on the value only, and RoPE scaling written in the config.json form the
loader reads back."""
import pytest
import torch

from unmask.train.corpus import CorpusFile
from unmask.train.data import DataError
from unmask.train.long_context import apply_rope_scaling, package_documents, package_of, passkey_rows, rope_scaling


def test_package_documents_join_files_per_package_in_path_order():
    files = [CorpusFile("stdlib", "json/encoder.py", "E"), CorpusFile("stdlib", "abc.py", "A"),
             CorpusFile("docs", "library/json.rst", "J"), CorpusFile("stdlib", "json/decoder.py", "D"),
             CorpusFile("docs", "library/re.rst", "R")]
    assert package_of(files[0]) == "stdlib/json" and package_of(files[1]) == "stdlib/abc.py"
    assert package_documents(files) == [
        "# file: library/json.rst\nJ\n\n# file: library/re.rst\nR",
        "# file: abc.py\nA",
        "# file: json/decoder.py\nD\n\n# file: json/encoder.py\nE",
    ]


def _encode(text: str) -> list[int]:
    return [ord(c) for c in text]  # one token a character: rows read back as text


def test_passkey_rows_exact_length_needle_buried_and_loss_on_the_value():
    haystack = _encode("".join(f"line {i} of some code\n" for i in range(400)))
    rows = passkey_rows(_encode, haystack, {ord("\n")}, 512, 6, seed=1)
    assert rows.ids.shape == (6, 512) and rows.loss_mask.shape == (6, 512)
    depths = []
    for ids, mask in zip(rows.ids.tolist(), rows.loss_mask):
        text = "".join(map(chr, ids))
        value = text[-6:-1]
        assert value.isdigit() and text.endswith(f'\nPASSKEY = "{value}"')
        assert text.count(f'PASSKEY = "{value}"') == 2  # the buried line and the answer
        assert mask.nonzero().flatten().tolist() == list(range(506, 512))  # the value and its closing quote
        needle = text.index(f'\nPASSKEY = "{value}"')
        assert needle < 512 - 18
        depths.append(needle)
    assert len(set(depths)) == 6  # a new depth per row
    again = passkey_rows(_encode, haystack, {ord("\n")}, 512, 6, seed=1)
    assert torch.equal(again.ids, rows.ids)  # seeded
    with pytest.raises(DataError, match="no room"):
        passkey_rows(_encode, haystack, {ord("\n")}, 20, 1)


def test_rope_scaling_spec():
    assert rope_scaling("linear:4", 2048) == (
        {"rope_type": "linear", "factor": 4.0, "original_max_position_embeddings": 2048}, 8192)
    assert rope_scaling("yarn:2.5", 512)[1] == 1280
    for bad in ("ntk:4", "linear", "linear:x", "yarn:1", "linear:-2"):
        with pytest.raises(DataError, match="--rope-scaling must be TYPE:FACTOR"):
            rope_scaling(bad, 2048)


@pytest.mark.parametrize("kind", ["linear", "yarn"])
def test_rope_scaling_written_to_config_json_and_loaded_back(kind, tmp_path):
    from unmask.models.layers import rope_inv_freq
    from unmask.models.loader import load_model
    from unmask.train.checkpoint import export_model
    from unmask.train.model_init import fresh_model, new_unmask_config

    cfg = new_unmask_config(96, 32, 2, 4, 2, 8, 64, 256, 4, mask_id=3, eos_ids=[2], tie_embeddings=True)
    tm = fresh_model(cfg, {"eos_token_id": [2]}, seed=0)
    plain = tm.model.rope.inv_freq.clone()
    scaling, context = rope_scaling(f"{kind}:4", 256)
    apply_rope_scaling(tm, scaling, context)
    assert tm.config["max_position_embeddings"] == 1024 and tm.config["rope_scaling"]["rope_type"] == kind
    if kind == "linear":  # position interpolation: every frequency divided by the factor
        assert torch.allclose(tm.model.rope.inv_freq, plain / 4)
    model, spec = load_model(export_model(tm, tmp_path / kind, None))
    assert spec.max_context == 1024 and model.cfg.rope_scaling == scaling
    expect, mscale = rope_inv_freq(model.rope.rotary_dim, model.cfg.rope_theta, scaling)
    assert torch.allclose(model.rope.inv_freq, expect) and model.rope.mscale == mscale
    assert torch.allclose(model.rope.inv_freq, tm.model.rope.inv_freq)  # training and serving agree


def _package_corpus(tmp_path, monkeypatch):
    """A char tokenizer that spells PASSKEY lines and paths, a corpus of two packages of three files, and
    `train`'s tiny flags at rows of 128."""
    import json

    import test_train
    from test_train import TINY_FLAGS, write_char_tokenizer

    monkeypatch.setattr(test_train, "CHARS", test_train.CHARS + "0123456789ACEKPSY/")  # PASSKEY, digits, paths
    tok = write_char_tokenizer(tmp_path / "tok")
    text = "".join(f"x = {i}\nprint(x)\n" for i in range(40))
    docs = [{"source": "stdlib", "path": f"{pkg}/m{i}.py", "text": text} for pkg in ("json", "email") for i in range(3)]
    data = tmp_path / "corpus"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    flags = list(TINY_FLAGS)
    flags[flags.index("--seq-len") + 1] = 128
    return tok, data, flags


def test_train_cli_long_context_options(tmp_path, monkeypatch):
    """`unmask train --long-documents --passkey-fraction --rope-scaling` on a tiny model: the passkey rows join the
    package rows, and the exported config.json holds the scaling the loader reads."""
    import json

    from test_train import _cli, _one_line_error
    from unmask.models.loader import load_model

    tok, data, flags = _package_corpus(tmp_path, monkeypatch)
    r = _cli("train", "--data", data, "--tokenizer", tok, "--out", tmp_path / "run", *flags, "--long-documents",
             "--passkey-fraction", 0.25, "--rope-scaling", "linear:2")
    assert r.exit_code == 0, r.output
    assert "long documents: 2 packages" in r.output and "passkey rows:" in r.output and "(25%)" in r.output
    cfg = json.loads((tmp_path / "run/model/config.json").read_text())
    # a fresh model's context: ModelShape's 2,048 (the CLI has no option for it), doubled
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": 2048}
    assert cfg["max_position_embeddings"] == 4096
    model, spec = load_model(tmp_path / "run/model")
    assert spec.max_context == 4096 and model.cfg.rope_scaling["factor"] == 2.0
    _one_line_error(_cli("train", "--data", data, "--tokenizer", tok, "--out", tmp_path / "bad", *flags,
                         "--rope-scaling", "ntk:4"), "--rope-scaling must be TYPE:FACTOR")


def test_mixed_text_rows_keep_their_loss_mask():
    """Passkey rows replayed among SFT rows keep the loss on the value only, plain rows stay loss-eligible."""
    from unmask.train.data import TokenRows, mix_rows

    sft = TokenRows(torch.zeros(4, 6, dtype=torch.int32), torch.tensor([[False] * 3 + [True] * 3] * 4))
    value_only = torch.tensor([[False] * 5 + [True]] * 4)
    text = TokenRows(torch.arange(24, dtype=torch.int32).view(4, 6) + 100, value_only)
    mixed = mix_rows(sft, text, 0.5, seed=0)
    assert mixed.ids.shape == (8, 6)
    assert torch.equal(mixed.loss_mask[:4], sft.loss_mask) and torch.equal(mixed.loss_mask[4:], value_only)


def test_finetune_replays_long_context_rows(tmp_path, monkeypatch):
    """`unmask finetune --mix-text --long-documents --passkey-fraction`: the replayed rows are train's package rows
    and passkey rows (so a long-context model's SFT keeps its retrieval), the rope scaling of the model is kept,
    and the flags without --mix-text are a one-line error."""
    import json

    from test_train import CHAT, _cli, _one_line_error

    tok, data, flags = _package_corpus(tmp_path, monkeypatch)
    r = _cli("train", "--data", data, "--tokenizer", tok, "--out", tmp_path / "base", *flags, "--rope-scaling",
             "yarn:2")
    assert r.exit_code == 0, r.output
    sft = tmp_path / "sft.jsonl"
    sft.write_text((json.dumps(CHAT) + "\n") * 8)
    tune = ["finetune", "-m", tmp_path / "base/model", "--data", sft, "--seq-len", 128, "--batch-size", 4,
            "--steps", 2, "--warmup", 0, "--eval-every", 0, "--no-bf16", "--pack"]
    r = _cli(*tune, "--out", tmp_path / "tuned", "--mix-text", data, "--mix-fraction", 0.5, "--long-documents",
             "--passkey-fraction", 0.5)
    assert r.exit_code == 0, r.output
    assert "long documents: 2 packages" in r.output and "passkey rows:" in r.output and "(50%)" in r.output
    cfg = json.loads((tmp_path / "tuned/model/config.json").read_text())
    assert cfg["rope_scaling"]["rope_type"] == "yarn" and cfg["rope_scaling"]["factor"] == 2.0
    _one_line_error(_cli(*tune, "--out", tmp_path / "bad", "--passkey-fraction", 0.5),
                    "--long-documents and --passkey-fraction shape the rows --mix-text replays")
    assert not (tmp_path / "bad").exists()
