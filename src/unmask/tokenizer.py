"""Tokenizer of a local model directory: encode, decode, chat template, incremental text."""
from __future__ import annotations

import json
from pathlib import Path

from unmask.errors import ModelLoadError


class Tokenizer:
    def __init__(self, path: str | Path, chat_template: str | None = None):
        import warnings

        from transformers import AutoTokenizer, PreTrainedTokenizerFast
        from transformers.utils import logging as hf_logging

        path = Path(path)
        hf_logging.set_verbosity_error()  # it reads config.json and warns about model types it does not know
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        except Exception:  # custom tokenizer classes (trust_remote_code): fall back to tokenizer.json
            if not (path / "tokenizer.json").is_file():
                raise ModelLoadError(f"{path} has no loadable tokenizer (tokenizer.json missing)") from None
            cfg_path = path / "tokenizer_config.json"
            cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
            specials = {k: v for k, v in cfg.items()
                        if k in ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token") and isinstance(v, str)}
            tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), **specials)
            if cfg.get("chat_template"):
                tok.chat_template = cfg["chat_template"]
        if chat_template is not None:
            tok.chat_template = chat_template
        self.hf = tok

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.hf.chat_template)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
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
