"""llguidance behind one small interface: a token table, grammar compilation, matchers.

One `GuidanceBackend` per engine (built on the first constrained request). It owns the llguidance
tokenizer (bytes of every token id, the stop ids as EOS), compiles a `StructuredSpec` to a grammar
(errors become `InvalidRequestError`, so an unsupported schema feature is a 400 naming it), and
makes a fresh `Constraint` (one matcher) per request.

The token table: byte-level BPE tokenizers (Qwen, Llama-3, unmask) are read directly from the
vocabulary, ~50 ms for 150K tokens and robust to vocabularies with unused ids; any other fast
tokenizer goes through llguidance's own Hugging Face loader.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence

from unmask.errors import InvalidRequestError
from unmask.structured.gemma4 import QUOTE
from unmask.structured.schema import Prepared, prepare
from unmask.structured.spec import StructuredSpec, styled_schema
from unmask.tokenizer import Tokenizer

# texts the budget closer tries, in order (constraint.py `closing_path`): inside a string close it first;
# elsewhere close containers first (`"` then opens and closes an empty string). Gemma 4's string quote
# (structured/gemma4.py) comes before `"`, which is plain text inside its strings; elsewhere it is refused.
CLOSERS = {"string": (QUOTE, '"', "}", "]", "0"), "value": ("}", "]", '"', QUOTE, "0")}
COMPILE_CACHE = 256


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable-unicode map used by byte-level BPE vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in table.items()}


def _decoder_type(hf) -> str | None:
    try:
        return (json.loads(hf.backend_tokenizer.to_str()).get("decoder") or {}).get("type")
    except Exception:  # noqa: BLE001 - slow tokenizers have no backend: llguidance's loader decides
        return None


class _TokenTable:
    """What llguidance's TokenizerWrapper reads: bytes per id (special tokens as 0xFF + name)."""

    def __init__(self, hf, n_vocab: int, eos: int):
        inv = _byte_decoder()
        added = hf.added_tokens_decoder
        self.special_token_ids = sorted(i for i, t in added.items() if t.special and i < n_vocab)
        special = set(self.special_token_ids)
        self.tokens: list[bytes] = [b""] * n_vocab  # unused ids stay empty: never allowed
        for text, i in hf.get_vocab().items():
            if i >= n_vocab:
                continue
            if i in special:
                self.tokens[i] = b"\xff" + text.encode()
            elif i in added:  # added tokens are stored as raw text, not in byte-level form
                self.tokens[i] = text.encode()
            else:
                self.tokens[i] = bytes(inv[c] for c in text)
        self.eos_token_id = eos
        self.bos_token_id = hf.bos_token_id
        self._hf = hf

    def __call__(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False)


class GuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: Sequence[int]):
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.tok = tokenizer
        hf = tokenizer.hf
        max_id = max(hf.get_vocab().values(), default=0)
        self.vocab_size = vocab_size               # rows of the model's logits
        n_vocab = max(vocab_size, max_id + 1)
        self.stop_ids = [i for i in stop_ids if 0 <= i < n_vocab]
        if not self.stop_ids:
            raise InvalidRequestError("structured output needs a model with an end-of-sequence token")
        if _decoder_type(hf) == "ByteLevel":
            table = _TokenTable(hf, n_vocab, self.stop_ids[0])
            self.lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(table), n_vocab=n_vocab,
                                                eos_token=self.stop_ids)
        else:
            try:
                self.lltok = llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab, eos_token=self.stop_ids)
            except Exception as e:  # noqa: BLE001 - reported per request, the server keeps serving
                raise InvalidRequestError(f"structured output is not available for this tokenizer: {e}") from None
        ids = {text: tokenizer.encode(text) for text in CLOSERS["string"]}
        self.closers = {ctx: [ids[t] for t in texts if ids[t]] for ctx, texts in CLOSERS.items()}  # token sequences
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, tuple[str, Prepared | None]] = OrderedDict()
        self._facts = None

    # ------------------------------------------------------------------ compiling
    def compile(self, spec: StructuredSpec) -> str:
        """The llguidance grammar of `spec`, checked against this tokenizer; InvalidRequestError if not enforceable."""
        return self.prepared(spec)[0]

    def prepared(self, spec: StructuredSpec) -> tuple[str, Prepared | None]:
        """(grammar, the JSON schema's Prepared or None): cached per spec. A JSON schema goes through
        schema.prepare first (strict mode, unknown formats, what is checked after the draft)."""
        key = spec.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        prep = None
        if spec.kind == "json":
            try:
                prep = prepare(spec.value, spec.strict, self._schema_error, relax=not spec.param.startswith("tools"))
            except InvalidRequestError as e:
                raise InvalidRequestError(f"{spec.param} cannot be enforced: {_what(spec)}{e}", spec.param) from None
            grammar = self.llg.LLMatcher.grammar_from_json_schema(styled_schema(prep.enforced, prep.coerce_one_of))
        else:
            grammar = self._grammar(spec)
            bad, messages = self.llg.LLMatcher.validate_grammar_with_warnings(grammar, self.lltok)
            if bad:
                raise InvalidRequestError(f"{spec.param} cannot be enforced: {_what(spec)}{messages[0]}", spec.param)
        with self._lock:
            self._cache[key] = (grammar, prep)
            if len(self._cache) > COMPILE_CACHE:
                self._cache.popitem(last=False)
        return grammar, prep

    def _schema_error(self, schema, coerce_one_of: bool) -> str | None:
        """llguidance's complaint about a JSON schema, or None when it compiles for this tokenizer."""
        M = self.llg.LLMatcher
        try:
            grammar = M.grammar_from_json_schema(styled_schema(schema, coerce_one_of))
        except ValueError as e:
            return str(e)
        bad, messages = M.validate_grammar_with_warnings(grammar, self.lltok)
        return messages[0] if bad else None

    def _grammar(self, spec: StructuredSpec) -> str:
        M = self.llg.LLMatcher
        try:
            if spec.kind == "regex":
                return M.grammar_from_regex(spec.value)
            if spec.kind == "choice":
                return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.value))
            return M.grammar_from_lark(spec.value)
        except ValueError as e:
            raise InvalidRequestError(f"{spec.param} cannot be enforced: {e}", spec.param) from None

    # ------------------------------------------------------------------ token facts (the JSON guard)
    def token_facts(self):
        """Per token id: its bytes, whether it holds a `"`, whether it starts with a digit (built once)."""
        if self._facts is None:
            from unmask.structured.guard import TokenFacts

            self._facts = TokenFacts([self.lltok.decode_bytes([i]) if i not in self.stop_ids else b""
                                      for i in range(self.vocab_size)])
        return self._facts

    # ------------------------------------------------------------------ per request
    def constraint(self, spec: StructuredSpec):
        from unmask.structured.constraint import Constraint

        grammar, prep = self.prepared(spec)
        matcher = self.llg.LLMatcher(self.lltok, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{spec.param} cannot be enforced: {matcher.get_error()}", spec.param)
        return Constraint(matcher, self, json=spec.kind == "json", check=prep.check if prep else None,
                          relaxed=(*prep.relaxed, *prep.rewritten) if prep else (),
                          unique=dict(prep.unique) if prep else {})


def _what(spec: StructuredSpec) -> str:
    return {"json": "unsupported or invalid JSON Schema: ", "regex": "invalid or unsupported regex: ",
            "grammar": "invalid or unsupported grammar: "}.get(spec.kind, "")
