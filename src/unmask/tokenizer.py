"""Tokenizer of a local model directory: encode, decode, chat template, incremental text."""
from __future__ import annotations

import functools
import json
import re
import threading
from pathlib import Path

from unmask.errors import ModelLoadError


SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token", "sep_token", "cls_token")


def read_json_object(path: Path) -> dict:
    """A model directory's JSON file (config, generation or tokenizer config); a damaged one is a ModelLoadError."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable bytes stand for themselves, the others are shifted to
    code points from 256 up (the table byte-level BPE tokenizers write their pieces in)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _config(path: Path) -> dict:
    f = path / "tokenizer_config.json"
    return read_json_object(f) if f.is_file() else {}


def _special_names(cfg: dict) -> list[str]:
    names = [v if isinstance(v, str) else v.get("content") for k in SPECIAL_KEYS if (v := cfg.get(k))]
    extra = cfg.get("additional_special_tokens") or cfg.get("extra_special_tokens") or []
    names += [t if isinstance(t, str) else t.get("content") for t in (extra if isinstance(extra, list) else [])]
    return [n for n in names if isinstance(n, str)]


def plain_tokenizer(path: Path):
    """`tokenizers.Tokenizer` of tokenizer.json when it alone gives transformers' encode and decode, else None.

    That holds for the generic fast class (no class-specific normalisation) with clean-up off, when every
    token the config declares special is a special added token of tokenizer.json (so decoding skips the same
    ids) and the config adds no token of its own. The built-in model qualifies; importing transformers
    (~1.2 s of every CLI start) is then left until something needs it (chat templates, grammars, training).
    """
    cfg = _config(path)
    if cfg.get("tokenizer_class") != "PreTrainedTokenizerFast" or cfg.get("clean_up_tokenization_spaces"):
        return None
    if not (path / "tokenizer.json").is_file() or cfg.get("add_bos_token") or cfg.get("add_eos_token"):
        return None
    from tokenizers import Tokenizer as RawTokenizer

    tok = RawTokenizer.from_file(str(path / "tokenizer.json"))
    added = {t.content: t for t in tok.get_added_tokens_decoder().values()}
    if any(n not in added or not added[n].special for n in _special_names(cfg)):
        return None
    for i, t in (cfg.get("added_tokens_decoder") or {}).items():  # transformers would add or re-flag these
        mine = added.get(t.get("content"))
        if tok.id_to_token(int(i)) != t.get("content") or mine is None or mine.special != bool(t.get("special")):
            return None
    return tok



_TRANSFORMERS_IMPORT = threading.Lock()


def from_transformers(*names: str) -> tuple:
    """transformers' `names`, imported under one lock: its lazily loaded package fails with "cannot import name"
    when two threads first import from it at once (unmask serve loads the model's tokenizer and the embedding
    model in parallel threads)."""
    with _TRANSFORMERS_IMPORT:
        import transformers

        return tuple(getattr(transformers, n) for n in names)

class Tokenizer:
    def __init__(self, path: str | Path, chat_template: str | None = None):
        self.path = Path(path)
        self._chat_template = chat_template
        self._hf = None
        self._plain = plain_tokenizer(self.path)
        if self._plain is None:
            self._load_hf()

    def _load_hf(self):
        import warnings

        AutoTokenizer, PreTrainedTokenizerFast = from_transformers("AutoTokenizer", "PreTrainedTokenizerFast")
        from transformers.utils import logging as hf_logging

        path = self.path
        hf_logging.set_verbosity_error()  # it reads config.json and warns about model types it does not know
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        except Exception:  # custom tokenizer classes (trust_remote_code): fall back to tokenizer.json
            if not (path / "tokenizer.json").is_file():
                raise ModelLoadError(f"{path} has no loadable tokenizer (tokenizer.json missing)") from None
            cfg = _config(path)
            specials = {k: v for k, v in cfg.items()
                        if k in ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token") and isinstance(v, str)}
            tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), **specials)
            if cfg.get("chat_template"):
                tok.chat_template = cfg["chat_template"]
        if self._chat_template is not None:
            tok.chat_template = self._chat_template
        self._hf = tok
        return tok

    @property
    def hf(self):
        """The transformers tokenizer (loaded on first use when tokenizer.json alone serves encode/decode)."""
        return self._hf if self._hf is not None else self._load_hf()

    @property
    def vocab_size(self) -> int:
        if self._plain is not None:
            return self._plain.get_vocab_size(with_added_tokens=True)
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        if self._chat_template is not None:
            return True
        if self._hf is None and (_config(self.path).get("chat_template") or (self.path / "chat_template.jinja").is_file()):
            return True
        return bool(self.hf.chat_template)

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        """Token ids of `text`. `parse_special=False` reads special-token text (`<|endoftext|>`) as plain text,
        as llama.cpp's /infill does for code: a file that mentions a control token must not inject it."""
        if self._plain is not None:
            if parse_special:
                return self._plain.encode(text, add_special_tokens=False).ids
            return self._literal_tokenizer().encode(text, add_special_tokens=False).ids
        if parse_special:
            return self.hf.encode(text, add_special_tokens=False)
        return self.hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def _literal_tokenizer(self):
        # a second instance: flipping encode_special_tokens on the shared one would race other encodes
        if getattr(self, "_literal", None) is None:
            from tokenizers import Tokenizer as RawTokenizer

            self._literal = RawTokenizer.from_str(self._plain.to_str())
            self._literal.encode_special_tokens = True
        return self._literal

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._plain is not None:
            return self._plain.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_texts(self, n: int) -> list[str]:
        """The text of each of the first `n` token ids alone (special tokens as written)."""
        ids = [[i] for i in range(n)]
        if self._plain is not None:
            return self._plain.decode_batch(ids, skip_special_tokens=False)
        return self.hf.batch_decode(ids, skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (OpenAI's logprob `bytes`): a byte-level BPE piece, or a byte-fallback
        `<0xHH>` piece, is one part of a UTF-8 character that its text alone (U+FFFD) cannot show."""
        piece = self._plain.id_to_token(token_id) if self._plain is not None else self.hf.convert_ids_to_tokens(token_id)
        special = self._special_pieces()
        if piece is None or piece in special:
            return self.decode([token_id], skip_special_tokens=False).encode()
        m = _BYTE_PIECE.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        if self._byte_level():
            table = _unicode_to_byte()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        return self.decode([token_id], skip_special_tokens=False).encode()

    def _special_pieces(self) -> frozenset[str]:
        if getattr(self, "_special", None) is None:
            if self._plain is not None:
                added = self._plain.get_added_tokens_decoder().values()
                self._special = frozenset(t.content for t in added)
            else:
                self._special = frozenset(self.hf.all_special_tokens) | frozenset(self.hf.get_added_vocab())
        return self._special

    def _byte_level(self) -> bool:
        """Whether token pieces are written in GPT-2's byte-to-unicode alphabet (a ByteLevel decoder)."""
        if getattr(self, "_is_byte_level", None) is None:
            f = self.path / "tokenizer.json"
            decoder = read_json_object(f).get("decoder") if f.is_file() else None
            parts = (decoder or {}).get("decoders", [decoder]) if isinstance(decoder, dict) else []
            self._is_byte_level = any(isinstance(d, dict) and d.get("type") == "ByteLevel" for d in parts)
        return self._is_byte_level

    def token_id(self, token: str) -> int | None:
        if self._plain is not None:
            return self._plain.token_to_id(token)
        i = self.hf.convert_tokens_to_ids(token)
        return None if i is None or i == self.hf.unk_token_id and token != self.hf.unk_token else i

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, **kwargs) -> str:
        if not self.has_chat_template:
            raise ModelLoadError("this model's tokenizer has no chat template; pass one with --chat-template")
        return self.hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                           add_generation_prompt=add_generation_prompt, **kwargs)


class IncrementalDecoder:
    """Turns an append-only token stream into append-only text (no broken UTF-8 sequences)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.tok.decode(self.ids, self.skip)
        if text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            return ""
        delta = text[len(self.text):] if text.startswith(self.text) else text
        self.text = text
        return delta
